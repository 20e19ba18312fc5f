//! The control protocol between the driver's [`super::rank::Rendezvous`] and each rank: one
//! TCP connection per rank carrying length-prefixed frames, `[u32 length LE][u8 tag][payload]`
//! (`length` counts the tag and the payload, at most [`MAX_FRAME_BYTES`]).
//!
//! ```text
//! rank → driver  Hello{token, rank, mesh_address}
//! driver → rank  Init(InitSpec as JSON)
//! rank → driver  Loaded{num_kv_blocks, kv_bytes_per_token} | LoadFailed{message}
//! per step:
//! driver → rank  Step{seq, greedy, micro_batches, StepBatch}
//! rank → driver  StepDone{seq, compute_ns, one StageOutput per micro-batch} | StepFailed{message}
//! driver → rank  Shutdown (or the connection closes: the rank exits either way)
//! ```
//!
//! Payloads are little-endian: `u32`/`u64` integers, `f32` values, strings and arrays as a
//! `u32` count then the items. A `StepBatch` is `n` then `n` token ids, positions and slots,
//! then the sequences (`query_start, query_len, context_len, want_logits as u8`, block
//! table). A `StageOutput` is a `u8` kind (0 forwarded, 1 logits `rows, vocab, rows·vocab
//! f32`, 2 greedy ids). Every count is checked against the bytes left in the frame before
//! anything is allocated, so a malformed frame is an error ([`WireError::Malformed`]), never
//! a panic or a huge allocation.

use std::io::{Read, Write};

use super::stage::{InitSpec, StageOutput};
use crate::backend::{Logits, SeqStep, StepBatch};

/// Largest frame accepted (a step of 8192 logit rows of a 32k vocabulary fits).
pub const MAX_FRAME_BYTES: usize = 1 << 30;

/// One control message (see the module docs).
#[derive(Debug)]
pub enum Msg {
    /// A rank joins: the group's token, its rank and its host-communicator address.
    Hello {
        /// The group's secret.
        token: String,
        /// Global rank.
        rank: usize,
        /// `host:port` of its mesh listener.
        mesh_address: String,
    },
    /// What the rank loads and the mesh it connects.
    Init(Box<InitSpec>),
    /// The rank's shard is loaded and its mesh formed.
    Loaded {
        /// KV blocks the rank allocated.
        num_kv_blocks: usize,
        /// KV bytes per token on the rank.
        kv_bytes_per_token: usize,
    },
    /// The rank could not load (it exits after sending this).
    LoadFailed {
        /// Why.
        message: String,
    },
    /// Run a step.
    Step {
        /// Step number (answers carry it back).
        seq: u64,
        /// Argmax instead of logit rows.
        greedy: bool,
        /// Micro-batches to split the batch into.
        micro_batches: usize,
        /// The step.
        batch: StepBatch,
    },
    /// A step's outputs, one per micro-batch.
    StepDone {
        /// The step number.
        seq: u64,
        /// Per micro-batch, in order.
        outputs: Vec<StageOutput>,
        /// Nanoseconds the rank spent running the step (receipt of the batch to its
        /// outputs), so the driver can tell compute from the control path's overhead.
        /// Frames of tag 6 (without it) decode with 0.
        compute_ns: u64,
    },
    /// The step failed on this rank (it exits after sending this).
    StepFailed {
        /// Why.
        message: String,
    },
    /// Exit.
    Shutdown,
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed or closed.
    #[error("control connection: {0}")]
    Io(#[from] std::io::Error),
    /// The frame does not decode.
    #[error("malformed control frame: {0}")]
    Malformed(String),
}

const HELLO: u8 = 1;
const INIT: u8 = 2;
const LOADED: u8 = 3;
const LOAD_FAILED: u8 = 4;
const STEP: u8 = 5;
const STEP_DONE: u8 = 6;
const STEP_FAILED: u8 = 7;
const SHUTDOWN: u8 = 8;
/// `StepDone` with the rank's compute time after `seq` (tag 6 is the form without it).
const STEP_DONE_TIMED: u8 = 9;

struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, v: usize) {
        self.u32(u32::try_from(v).unwrap_or(u32::MAX));
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn u32s(&mut self, v: &[u32]) {
        self.len(v.len());
        for x in v {
            self.u32(*x);
        }
    }
    fn f32s(&mut self, v: &[f32]) {
        self.len(v.len());
        self.0.reserve(v.len() * 4);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
}

struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.0.len() {
            return Err(WireError::Malformed(format!("needs {n} more bytes, {} left", self.0.len())));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn usize(&mut self) -> Result<usize, WireError> {
        usize::try_from(self.u64()?).map_err(|_| WireError::Malformed("count out of range".into()))
    }
    /// A count of items of `item` bytes each, checked against what is left.
    fn count(&mut self, item: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(item) > self.0.len() {
            return Err(WireError::Malformed(format!("{n} items of {item} bytes, {} bytes left", self.0.len())));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String, WireError> {
        let n = self.count(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| WireError::Malformed("string is not UTF-8".into()))
    }
    fn u32s(&mut self) -> Result<Vec<u32>, WireError> {
        let n = self.count(4)?;
        Ok(self.take(n * 4)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    fn f32s(&mut self) -> Result<Vec<f32>, WireError> {
        let n = self.count(4)?;
        Ok(self.take(n * 4)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

fn encode_batch(e: &mut Enc, b: &StepBatch) {
    e.u32s(&b.token_ids);
    e.u32s(&b.positions);
    e.u32s(&b.slot_mapping);
    e.len(b.seqs.len());
    for s in &b.seqs {
        e.u64(s.query_start as u64);
        e.u64(s.query_len as u64);
        e.u64(s.context_len as u64);
        e.u8(u8::from(s.want_logits));
        e.u32s(&s.block_table);
    }
}

fn decode_batch(d: &mut Dec<'_>) -> Result<StepBatch, WireError> {
    let token_ids = d.u32s()?;
    let positions = d.u32s()?;
    let slot_mapping = d.u32s()?;
    let n = d.count(29)?;
    let mut seqs = Vec::with_capacity(n);
    for _ in 0..n {
        seqs.push(SeqStep {
            query_start: d.usize()?,
            query_len: d.usize()?,
            context_len: d.usize()?,
            want_logits: d.u8()? != 0,
            block_table: d.u32s()?,
        });
    }
    Ok(StepBatch { token_ids, positions, slot_mapping, seqs })
}

/// The frame of `msg` (length prefix included).
pub fn encode(msg: &Msg) -> Vec<u8> {
    let mut e = Enc(vec![0; 4]);
    match msg {
        Msg::Hello { token, rank, mesh_address } => {
            e.u8(HELLO);
            e.str(token);
            e.u64(*rank as u64);
            e.str(mesh_address);
        }
        Msg::Init(spec) => {
            e.u8(INIT);
            e.str(&serde_json::to_string(spec).unwrap_or_default());
        }
        Msg::Loaded { num_kv_blocks, kv_bytes_per_token } => {
            e.u8(LOADED);
            e.u64(*num_kv_blocks as u64);
            e.u64(*kv_bytes_per_token as u64);
        }
        Msg::LoadFailed { message } => {
            e.u8(LOAD_FAILED);
            e.str(message);
        }
        Msg::Step { seq, greedy, micro_batches, batch } => return encode_step(*seq, *greedy, *micro_batches, batch),
        Msg::StepDone { seq, outputs, compute_ns } => {
            e.u8(STEP_DONE_TIMED);
            e.u64(*seq);
            e.u64(*compute_ns);
            e.len(outputs.len());
            for o in outputs {
                match o {
                    StageOutput::Forwarded => e.u8(0),
                    StageOutput::Logits(l) => {
                        e.u8(1);
                        e.u64(l.rows as u64);
                        e.u64(l.vocab_size as u64);
                        e.f32s(&l.data);
                    }
                    StageOutput::Greedy(ids) => {
                        e.u8(2);
                        e.u32s(ids);
                    }
                }
            }
        }
        Msg::StepFailed { message } => {
            e.u8(STEP_FAILED);
            e.str(message);
        }
        Msg::Shutdown => e.u8(SHUTDOWN),
    }
    finish(e)
}

/// The frame of a `Step` message, from a borrowed batch (the driver's per-step path).
pub fn encode_step(seq: u64, greedy: bool, micro_batches: usize, batch: &StepBatch) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(64 + batch.token_ids.len() * 12 + batch.seqs.len() * 64));
    e.0.extend_from_slice(&[0; 4]);
    e.u8(STEP);
    e.u64(seq);
    e.u8(u8::from(greedy));
    e.u64(micro_batches as u64);
    encode_batch(&mut e, batch);
    finish(e)
}

fn finish(mut e: Enc) -> Vec<u8> {
    let len = u32::try_from(e.0.len() - 4).unwrap_or(u32::MAX);
    e.0[..4].copy_from_slice(&len.to_le_bytes());
    e.0
}

/// Decodes one frame's body (tag and payload, without the length prefix).
///
/// # Errors
/// [`WireError::Malformed`] on an unknown tag, a short or oversized field, bad JSON or
/// trailing bytes.
pub fn decode(body: &[u8]) -> Result<Msg, WireError> {
    let mut d = Dec(body);
    let msg = match d.u8()? {
        HELLO => Msg::Hello { token: d.str()?, rank: d.usize()?, mesh_address: d.str()? },
        INIT => {
            let json = d.str()?;
            Msg::Init(Box::new(
                serde_json::from_str(&json).map_err(|e| WireError::Malformed(format!("init spec: {e}")))?,
            ))
        }
        LOADED => Msg::Loaded { num_kv_blocks: d.usize()?, kv_bytes_per_token: d.usize()? },
        LOAD_FAILED => Msg::LoadFailed { message: d.str()? },
        STEP => {
            Msg::Step { seq: d.u64()?, greedy: d.u8()? != 0, micro_batches: d.usize()?, batch: decode_batch(&mut d)? }
        }
        tag @ (STEP_DONE | STEP_DONE_TIMED) => {
            let seq = d.u64()?;
            let compute_ns = if tag == STEP_DONE_TIMED { d.u64()? } else { 0 };
            let n = d.count(1)?;
            let mut outputs = Vec::with_capacity(n);
            for _ in 0..n {
                outputs.push(match d.u8()? {
                    0 => StageOutput::Forwarded,
                    1 => {
                        let (rows, vocab_size) = (d.usize()?, d.usize()?);
                        let data = d.f32s()?;
                        if rows.checked_mul(vocab_size) != Some(data.len()) {
                            return Err(WireError::Malformed("logits are not rows × vocab".into()));
                        }
                        StageOutput::Logits(Logits { rows, vocab_size, data })
                    }
                    2 => StageOutput::Greedy(d.u32s()?),
                    k => return Err(WireError::Malformed(format!("unknown stage output kind {k}"))),
                });
            }
            Msg::StepDone { seq, outputs, compute_ns }
        }
        STEP_FAILED => Msg::StepFailed { message: d.str()? },
        SHUTDOWN => Msg::Shutdown,
        t => return Err(WireError::Malformed(format!("unknown message tag {t}"))),
    };
    if !d.0.is_empty() {
        return Err(WireError::Malformed(format!("{} trailing bytes", d.0.len())));
    }
    Ok(msg)
}

/// Writes one message.
///
/// # Errors
/// The write's I/O error.
pub fn write_msg(w: &mut impl Write, msg: &Msg) -> Result<(), WireError> {
    w.write_all(&encode(msg))?;
    w.flush()?;
    Ok(())
}

/// Reads one message (blocking, or bounded by the stream's read timeout).
///
/// # Errors
/// [`WireError::Io`] when the connection fails or closes (`UnexpectedEof`),
/// [`WireError::Malformed`] for a length over [`MAX_FRAME_BYTES`] or a bad body.
pub fn read_msg(r: &mut impl Read) -> Result<Msg, WireError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME_BYTES {
        return Err(WireError::Malformed(format!("frame of {len} bytes (at most {MAX_FRAME_BYTES})")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    decode(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_malformed_frames_are_errors() {
        let batch = StepBatch {
            token_ids: vec![1, 2, 3],
            positions: vec![0, 1, 0],
            slot_mapping: vec![16, 17, 32],
            seqs: vec![
                SeqStep { query_start: 0, query_len: 2, context_len: 2, block_table: vec![1], want_logits: true },
                SeqStep { query_start: 2, query_len: 1, context_len: 1, block_table: vec![2], want_logits: false },
            ],
        };
        let frame = encode(&Msg::Step { seq: 7, greedy: true, micro_batches: 2, batch: batch.clone() });
        let Msg::Step { seq, greedy, micro_batches, batch: b } = read_msg(&mut &frame[..]).unwrap() else {
            panic!("not a step")
        };
        assert_eq!((seq, greedy, micro_batches), (7, true, 2));
        assert_eq!((b.token_ids, b.slot_mapping, b.seqs.len()), (batch.token_ids, batch.slot_mapping, 2));
        assert_eq!(b.seqs[1].query_start, 2);
        assert!(!b.seqs[1].want_logits);
        let outputs = vec![
            StageOutput::Forwarded,
            StageOutput::Logits(Logits { rows: 1, vocab_size: 2, data: vec![0.5, -1.0] }),
            StageOutput::Greedy(vec![4]),
        ];
        let frame = encode(&Msg::StepDone { seq: 3, outputs, compute_ns: 1234 });
        let Msg::StepDone { seq: 3, outputs, compute_ns: 1234 } = read_msg(&mut &frame[..]).unwrap() else {
            panic!("not done")
        };
        assert!(matches!(&outputs[1], StageOutput::Logits(l) if l.data == [0.5, -1.0]));
        assert!(matches!(&outputs[2], StageOutput::Greedy(ids) if ids == &[4]));

        // The form without the compute time (tag 6) still decodes.
        let mut old = vec![STEP_DONE];
        old.extend_from_slice(&5u64.to_le_bytes());
        old.extend_from_slice(&1u32.to_le_bytes());
        old.push(0);
        assert!(matches!(decode(&old), Ok(Msg::StepDone { seq: 5, compute_ns: 0, ref outputs }) if outputs.len() == 1));

        // Truncated, oversized, unknown and trailing frames fail cleanly.
        let frame = encode(&Msg::Hello { token: "t".into(), rank: 1, mesh_address: "a:1".into() });
        assert!(matches!(decode(&frame[4..frame.len() - 1]), Err(WireError::Malformed(_))));
        let mut huge = frame.clone();
        huge[5..9].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&huge[4..]), Err(WireError::Malformed(_))));
        let over = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes();
        assert!(matches!(read_msg(&mut &over[..]), Err(WireError::Malformed(_))));
        assert!(matches!(decode(&[99]), Err(WireError::Malformed(_))));
        let mut trailing = frame[4..].to_vec();
        trailing.push(0);
        assert!(matches!(decode(&trailing), Err(WireError::Malformed(_))));
        assert!(matches!(read_msg(&mut &[][..]), Err(WireError::Io(_))));
    }
}
