//! prism-worker library.
pub mod engine;
