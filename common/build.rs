//! Compiles `proto/prism/v1/*.proto` once for the whole workspace.
fn main() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let files = ["inference.proto", "head.proto", "worker.proto"].map(|f| root.join("prism/v1").join(f));
    println!("cargo:rerun-if-changed={}", root.display());
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("prism_descriptor.bin"))
        .compile_protos(&files, &[root])?;
    Ok(())
}
