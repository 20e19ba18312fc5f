//! The shape of a replica's rank group: `tensor_parallel_size × pipeline_parallel_size`
//! ranks in vLLM's order, `rank = pp_rank · tensor_parallel_size + tp_rank`, so a pipeline
//! stage's tensor-parallel ranks are contiguous (and sit on one node when they can: "TP
//! inside a node, PP across nodes"). Stage `p` runs a contiguous range of decoder layers; the
//! first stage also embeds the tokens, the last one applies the final norm and `lm_head`.

use std::ops::Range;

use crate::model::ModelConfig;
use crate::request::EngineError;

/// Tensor- and pipeline-parallel sizes of one replica (vLLM's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParallelSizes {
    /// Ranks per stage; each holds `1/tp` of every layer's heads and MLP columns.
    pub tensor_parallel_size: usize,
    /// Stages; each holds a contiguous range of layers.
    pub pipeline_parallel_size: usize,
}

impl Default for ParallelSizes {
    fn default() -> Self {
        Self { tensor_parallel_size: 1, pipeline_parallel_size: 1 }
    }
}

/// Where one rank sits in the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankCoords {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Rank within its stage's tensor-parallel group.
    pub tp_rank: usize,
    /// Pipeline stage.
    pub pp_rank: usize,
}

impl ParallelSizes {
    /// `tp` ranks per stage, `pp` stages.
    pub fn new(tensor_parallel_size: usize, pipeline_parallel_size: usize) -> Self {
        Self { tensor_parallel_size, pipeline_parallel_size }
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.tensor_parallel_size * self.pipeline_parallel_size
    }

    /// One rank: the replica runs unsharded in the driver's process.
    pub fn is_single(&self) -> bool {
        self.world_size() == 1
    }

    /// The coordinates of global `rank`.
    pub fn coords(&self, rank: usize) -> RankCoords {
        let tp = self.tensor_parallel_size.max(1);
        RankCoords { rank, tp_rank: rank % tp, pp_rank: rank / tp }
    }

    /// The global rank at (`tp_rank`, `pp_rank`).
    pub fn rank_of(&self, tp_rank: usize, pp_rank: usize) -> usize {
        pp_rank * self.tensor_parallel_size + tp_rank
    }

    /// The global ranks of stage `pp_rank`'s tensor-parallel group, ascending.
    pub fn tp_group(&self, pp_rank: usize) -> Vec<usize> {
        (0..self.tensor_parallel_size).map(|t| self.rank_of(t, pp_rank)).collect()
    }

    /// Decoder layers of stage `pp_rank` out of `num_layers`: contiguous ranges, the first
    /// `num_layers % pp` stages one layer longer.
    pub fn stage_layers(&self, pp_rank: usize, num_layers: usize) -> Range<usize> {
        let pp = self.pipeline_parallel_size.max(1);
        let (base, extra) = (num_layers / pp, num_layers % pp);
        let start = pp_rank * base + pp_rank.min(extra);
        start..start + base + usize::from(pp_rank < extra)
    }

    /// Whether the model can be split this way.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming `tensor_parallel_size` or
    /// `pipeline_parallel_size` and the numbers: a size of 0; `tp` not dividing the attention
    /// heads, the KV heads or the MLP width; more stages than layers.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<(), EngineError> {
        let (tp, pp) = (self.tensor_parallel_size, self.pipeline_parallel_size);
        let tp_err = |message: String| EngineError::InvalidRequest { field: "tensor_parallel_size", message };
        if tp == 0 {
            return Err(tp_err("tensor_parallel_size must be >= 1".into()));
        }
        if pp == 0 {
            return Err(EngineError::InvalidRequest {
                field: "pipeline_parallel_size",
                message: "pipeline_parallel_size must be >= 1".into(),
            });
        }
        for (what, n) in [
            ("num_attention_heads", cfg.num_attention_heads),
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("intermediate_size", cfg.intermediate_size),
        ] {
            if !n.is_multiple_of(tp) {
                return Err(tp_err(format!("tensor_parallel_size {tp} does not divide the model's {what} {n}")));
            }
        }
        if pp > cfg.num_hidden_layers {
            return Err(EngineError::InvalidRequest {
                field: "pipeline_parallel_size",
                message: format!(
                    "pipeline_parallel_size {pp} is more than the model's num_hidden_layers {}",
                    cfg.num_hidden_layers
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_vllm_order_and_stages_tile_the_layers() {
        let s = ParallelSizes::new(3, 2);
        assert_eq!(s.world_size(), 6);
        assert_eq!(s.coords(4), RankCoords { rank: 4, tp_rank: 1, pp_rank: 1 });
        assert_eq!(s.rank_of(1, 1), 4);
        assert_eq!(s.tp_group(1), vec![3, 4, 5]);
        let s = ParallelSizes::new(1, 4);
        let ranges: Vec<_> = (0..4).map(|p| s.stage_layers(p, 30)).collect();
        assert_eq!(ranges, vec![0..8, 8..16, 16..23, 23..30]);
    }
}
