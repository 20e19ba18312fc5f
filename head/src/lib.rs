//! prism-head library.
