//! Child processes of the tests: [`Process`] (piped output, signals, restart; what the
//! cluster fixture runs), [`ProcessGuard`] (a child the caller started itself, killed on
//! drop), and the process tree from `/proc` ([`descendants`], [`alive`]).

mod child;
mod guard;
mod tree;

pub use child::Process;
pub use guard::ProcessGuard;
pub use tree::{alive, descendants};
