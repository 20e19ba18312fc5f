//! `prism-rank`: a rank process of a parallel replica and nothing else (every Prism binary
//! can be one; this one is the smallest, used by the engine's tests). The rank's spec is
//! the JSON in `PRISM_RANK_SPEC` (`prism_engine::parallel::rank::RankSpec`).

use std::process::ExitCode;

fn main() -> ExitCode {
    prism_engine::parallel::rank::main_from_env().unwrap_or_else(|| {
        eprintln!(
            "usage: {}=<rank spec JSON> prism-rank\n\
             Runs one rank of a parallel replica; the driver starts it (the spec names the \
             rendezvous, the group token and the rank).",
            prism_engine::parallel::rank::RANK_SPEC_ENV
        );
        ExitCode::from(2)
    })
}
