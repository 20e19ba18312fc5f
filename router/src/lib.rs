//! prism-router library.
