//! The model root: the one directory a cluster's deployments may load models from.
//!
//! With a root configured (`--model-root` on the head and on every worker), a deployment's
//! `engine.model` must name a path under it. The head, which cannot see the workers' disks,
//! checks the path lexically ([`check_lexical`]): no `..` component, and an absolute path
//! must start with the root (a relative one is taken relative to the root). A worker, which
//! can, resolves symlinks too ([`check_on_disk`]): the canonical model path, and for a model
//! directory every file in it, must stay under the canonical root, so a symlink planted
//! inside the root cannot point out of it. Without a root nothing is restricted (a
//! single-user `prism up`, a test).

use std::path::{Component, Path, PathBuf};

/// Why a model path is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelRootError {
    /// The path has a `..` component.
    #[error("engine.model {model:?} contains a `..` component; paths under the model root may not climb out of it")]
    ParentComponent {
        /// The path as given.
        model: String,
    },
    /// An absolute path that does not start with the root.
    #[error("engine.model {model:?} is outside the model root {root}")]
    Outside {
        /// The path as given.
        model: String,
        /// The configured root.
        root: String,
    },
    /// The resolved path (symlinks followed) leaves the root.
    #[error(
        "engine.model {model:?} resolves to {resolved}, outside the model root {root} (a symlink points out of it)"
    )]
    SymlinkOut {
        /// The path as given.
        model: String,
        /// Where it resolves.
        resolved: String,
        /// The canonical root.
        root: String,
    },
    /// The path (or the root) does not exist or cannot be resolved.
    #[error("engine.model {model:?}: {path}: {reason}")]
    Unresolvable {
        /// The path as given.
        model: String,
        /// The path that failed to resolve.
        path: String,
        /// The I/O error.
        reason: String,
    },
}

/// The path `model` names, relative paths taken under `root`, after the lexical checks.
///
/// # Errors
/// [`ModelRootError::ParentComponent`] for a `..` anywhere, [`ModelRootError::Outside`] for
/// an absolute path that does not start with `root` (component-wise: `/models2` is not
/// under `/models`).
pub fn check_lexical(root: &Path, model: &str) -> Result<PathBuf, ModelRootError> {
    let p = Path::new(model);
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(ModelRootError::ParentComponent { model: model.to_owned() });
    }
    let joined = if p.is_absolute() { p.to_path_buf() } else { root.join(p) };
    // `Path::starts_with` compares components, so `/models/./x` and `/models//x` are under
    // `/models`, and `/models-other/x` is not.
    let root_clean: PathBuf = root.components().filter(|c| !matches!(c, Component::CurDir)).collect();
    let joined_clean: PathBuf = joined.components().filter(|c| !matches!(c, Component::CurDir)).collect();
    if !joined_clean.starts_with(&root_clean) {
        return Err(ModelRootError::Outside { model: model.to_owned(), root: root.display().to_string() });
    }
    Ok(joined_clean)
}

/// [`check_lexical`], then the filesystem check: the canonical path (symlinks resolved) is
/// under the canonical root, and so is every entry of a model directory. Returns the path to
/// load (the lexical one: the loader opens the same file the check resolved).
///
/// # Errors
/// As [`check_lexical`]; [`ModelRootError::Unresolvable`] when the root or the model does
/// not exist; [`ModelRootError::SymlinkOut`] when a symlink leads out of the root.
pub fn check_on_disk(root: &Path, model: &str) -> Result<PathBuf, ModelRootError> {
    let path = check_lexical(root, model)?;
    let resolve = |p: &Path| {
        std::fs::canonicalize(p).map_err(|e| ModelRootError::Unresolvable {
            model: model.to_owned(),
            path: p.display().to_string(),
            reason: e.to_string(),
        })
    };
    let root_real = resolve(root)?;
    let inside = |p: &Path| -> Result<(), ModelRootError> {
        let real = resolve(p)?;
        if real.starts_with(&root_real) {
            Ok(())
        } else {
            Err(ModelRootError::SymlinkOut {
                model: model.to_owned(),
                resolved: real.display().to_string(),
                root: root_real.display().to_string(),
            })
        }
    };
    inside(&path)?;
    if path.is_dir() {
        let entries = std::fs::read_dir(&path).map_err(|e| ModelRootError::Unresolvable {
            model: model.to_owned(),
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        for entry in entries.flatten() {
            // A dangling symlink cannot be loaded either; it is refused like one pointing out.
            inside(&entry.path())?;
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_escapes_are_refused_and_paths_under_the_root_pass() {
        let root = Path::new("/models");
        assert_eq!(check_lexical(root, "/models/smol.gguf"), Ok(PathBuf::from("/models/smol.gguf")));
        assert_eq!(check_lexical(root, "smol.gguf"), Ok(PathBuf::from("/models/smol.gguf")));
        assert_eq!(check_lexical(root, "/models/./a//b"), Ok(PathBuf::from("/models/a/b")));
        for bad in ["../etc/passwd", "/models/../etc/passwd", "a/../../b", "/models/a/.."] {
            assert!(
                matches!(check_lexical(root, bad), Err(ModelRootError::ParentComponent { .. })),
                "{bad}: {:?}",
                check_lexical(root, bad)
            );
        }
        for bad in ["/etc/passwd", "/models-other/x.gguf", "/model", "/"] {
            let e = check_lexical(root, bad).expect_err(bad);
            assert!(matches!(e, ModelRootError::Outside { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("engine.model") && e.to_string().contains("/models"), "{e}");
        }
    }

    #[test]
    fn symlinks_out_of_the_root_and_missing_paths_are_refused_on_disk() -> Result<(), Box<dyn std::error::Error>> {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(root.join("hf"))?;
        std::fs::create_dir_all(&outside)?;
        std::fs::write(root.join("good.gguf"), b"x")?;
        std::fs::write(outside.join("secret.gguf"), b"x")?;
        std::fs::write(root.join("hf/config.json"), b"{}")?;
        // A link inside the root to a file inside the root is fine (Hugging Face caches
        // link snapshots to blobs).
        std::os::unix::fs::symlink(root.join("good.gguf"), root.join("alias.gguf"))?;
        std::os::unix::fs::symlink(outside.join("secret.gguf"), root.join("escape.gguf"))?;
        std::os::unix::fs::symlink(&outside, root.join("escape-dir"))?;
        let root_s = root.to_str().ok_or("utf-8")?;
        assert_eq!(check_on_disk(&root, "good.gguf")?, root.join("good.gguf"));
        assert_eq!(check_on_disk(&root, &format!("{root_s}/alias.gguf"))?, root.join("alias.gguf"));
        assert_eq!(check_on_disk(&root, "hf")?, root.join("hf"));
        for bad in ["escape.gguf", "escape-dir/secret.gguf", "escape-dir"] {
            let e = check_on_disk(&root, bad).expect_err(bad);
            assert!(matches!(e, ModelRootError::SymlinkOut { .. }), "{bad}: {e}");
        }
        // A file inside a model directory linking out of the root.
        std::os::unix::fs::symlink(outside.join("secret.gguf"), root.join("hf/model.safetensors"))?;
        let e = check_on_disk(&root, "hf").expect_err("dir with a link out");
        assert!(matches!(&e, ModelRootError::SymlinkOut { resolved, .. } if resolved.ends_with("secret.gguf")), "{e}");
        let e = check_on_disk(&root, "missing.gguf").expect_err("missing");
        assert!(matches!(&e, ModelRootError::Unresolvable { .. }), "{e}");
        assert!(e.to_string().contains("missing.gguf") && e.to_string().contains("No such file"), "{e}");
        let e = check_on_disk(&root, "../outside/secret.gguf").expect_err("parent");
        assert!(matches!(e, ModelRootError::ParentComponent { .. }), "{e}");
        Ok(())
    }
}
