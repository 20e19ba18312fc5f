//! Kernel timing shared by the CUDA micro-benchmarks: single launches, each after the L2 is
//! flushed (a memset over a buffer larger than the L2), timed with CUDA events.

use anyhow::{Context, Result};
use cudarc::driver::result;
use cudarc::driver::sys::CUevent_flags;
use prism_engine::backend::cuda::device::{DevBuf, Gpu};

/// Median and min (µs) of `reps` single launches of `f`, each after an L2 flush (three
/// untimed launches first).
pub fn time_cold(gpu: &Gpu, flush: &DevBuf, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let ev: Vec<_> = (0..2 * reps)
        .map(|_| gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).context("event"))
        .collect::<Result<_>>()?;
    for r in 0..reps + 3 {
        // SAFETY: `flush` holds `flush.bytes` bytes on this context.
        unsafe { result::memset_d8_async(flush.ptr, (r & 0xff) as u8, flush.bytes, gpu.stream.cu_stream()) }
            .context("memset")?;
        if r >= 3 {
            ev[2 * (r - 3)].record(&gpu.stream)?;
        }
        f()?;
        if r >= 3 {
            ev[2 * (r - 3) + 1].record(&gpu.stream)?;
        }
    }
    gpu.sync()?;
    let mut t: Vec<f64> = (0..reps)
        .map(|i| ev[2 * i].elapsed_ms(&ev[2 * i + 1]).map(|ms| f64::from(ms) * 1e3))
        .collect::<Result<_, _>>()?;
    t.sort_by(f64::total_cmp);
    Ok((t[reps / 2], t[0]))
}
