//! What the head's table says of each served model from its deployment's spec
//! ([`ModelSettings`]: configured context length, codec id), known while no replica serves it.

/// What the head's table says of a served model from its deployment's spec
/// (`RouteTable.served`), known also while no replica serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSettings {
    /// The spec's `max_model_len`; 0 = not set (known once a replica reports it).
    pub max_model_len: u32,
    /// Identifies the prompt codec the deployment's next replica loads (never 0 from the
    /// head; 0 = unknown: static routes, a head that predates it).
    pub codec_id: u64,
}
