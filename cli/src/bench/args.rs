//! `prism bench serve` flags, named as `vllm bench serve` names them (`--dataset-name`,
//! `--num-prompts`, `--request-rate`, `--burstiness`, `--max-concurrency`, `--ramp-up-*`,
//! `--random-*`, `--goodput`, `--percentile-metrics`, `--metric-percentiles`,
//! `--save-result`, `--result-dir`, `--result-filename`, `--ignore-eos`, `--seed`), plus the
//! Prism datasets' own (`--multi-turn-*`), `--prefix-repetition-*` (vLLM's), `--metrics-url`
//! and `--result-file`. The older `--concurrency` and
//! `--requests` remain as aliases of `--max-concurrency` and `--num-prompts`.

use super::arrivals::{Ramp, RampUpStrategy, Schedule};
use super::dataset::prefix_repetition::{self, PrefixForm, PrefixRepetitionConfig};
use super::dataset::{self, BenchRequest, DatasetError, MultiTurnConfig, RandomConfig};
use super::transport::{Backend, Target};
use crate::client::ModelArg;
use clap::Args;
use rand::rngs::StdRng;
use std::path::PathBuf;

/// The prompt sets of `--dataset-name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetName {
    /// Random token ids (`--random-*`).
    Random,
    /// Conversations sharing a system prompt, each turn extending the history (`--multi-turn-*`).
    MultiTurn,
    /// Requests over a few shared prefixes, each with its own suffix (`--prefix-repetition-*`).
    #[value(name = "prefix_repetition", alias = "prefix-repetition")]
    PrefixRepetition,
    /// A JSONL file of prompts (`--dataset-path`).
    #[value(alias = "jsonl")]
    Custom,
}

impl DatasetName {
    /// The name in the result file.
    pub fn name(self) -> &'static str {
        match self {
            DatasetName::Random => "random",
            DatasetName::MultiTurn => "multi-turn",
            DatasetName::PrefixRepetition => "prefix_repetition",
            DatasetName::Custom => "custom",
        }
    }
}

/// `--request-rate`: a positive number of requests/s, or `inf`.
fn parse_rate(s: &str) -> Result<f64, String> {
    if s.eq_ignore_ascii_case("inf") {
        return Ok(f64::INFINITY);
    }
    match s.parse::<f64>() {
        Ok(r) if r > 0.0 => Ok(r),
        _ => Err(format!("expected a positive number of requests/s or inf, got {s:?}")),
    }
}

/// `prism bench serve` flags.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// `--model`: the served model to load.
    #[command(flatten)]
    pub model: ModelArg,
    /// API to load: `grpc` (the router's InferenceService at --router), `openai`
    /// (/v1/completions at --base-url) or `openai-chat` (/v1/chat/completions).
    #[arg(long, value_enum, env = "PRISM_BENCH_BACKEND", default_value_t = Backend::Grpc)]
    pub backend: Backend,
    /// OpenAI HTTP base URL of the router (the `openai` backends).
    #[arg(long, env = "PRISM_BASE_URL", default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// HTTP path (default: /v1/completions, or /v1/chat/completions for openai-chat).
    #[arg(long, env = "PRISM_BENCH_ENDPOINT")]
    pub endpoint: Option<String>,
    /// API key, sent as `authorization: Bearer KEY`. A comma-separated list (PRISM_API_KEY as
    /// `prism up` and prism-router read it) sends its first key.
    #[arg(long, env = "PRISM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Prompt set: random, multi-turn, prefix_repetition or custom (JSONL, alias jsonl).
    #[arg(long, value_enum, env = "PRISM_BENCH_DATASET_NAME", default_value_t = DatasetName::Random)]
    pub dataset_name: DatasetName,
    /// The JSONL file of `--dataset-name custom`.
    #[arg(long, env = "PRISM_BENCH_DATASET_PATH")]
    pub dataset_path: Option<PathBuf>,
    /// Requests to send (default: 1000 for random and prefix_repetition; every turn of
    /// multi-turn; every line of custom). Fewer than the set cuts it, more repeats it.
    #[arg(long, visible_alias = "requests", env = "PRISM_BENCH_NUM_PROMPTS")]
    pub num_prompts: Option<usize>,
    /// Seed of the datasets and of the arrival times.
    #[arg(long, env = "PRISM_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,

    /// random: mean input tokens per request (after the prefix).
    #[arg(long, env = "PRISM_BENCH_RANDOM_INPUT_LEN", default_value_t = 1024)]
    pub random_input_len: usize,
    /// random: mean output tokens per request (max_tokens).
    #[arg(long, env = "PRISM_BENCH_RANDOM_OUTPUT_LEN", default_value_t = 128)]
    pub random_output_len: u32,
    /// random: lengths uniform in [len·(1−r), len·(1+r)], r in [0, 1).
    #[arg(long, env = "PRISM_BENCH_RANDOM_RANGE_RATIO", default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// random: tokens of a prefix shared by every request.
    #[arg(long, env = "PRISM_BENCH_RANDOM_PREFIX_LEN", default_value_t = 0)]
    pub random_prefix_len: usize,
    /// random, prefix_repetition: token ids are drawn below this (keep it at or under the
    /// model's vocabulary).
    #[arg(long, env = "PRISM_BENCH_RANDOM_VOCAB_SIZE", default_value_t = 32000)]
    pub random_vocab_size: u32,

    /// multi-turn: conversations sharing the system prompt.
    #[arg(long, env = "PRISM_BENCH_MULTI_TURN_CONVERSATIONS", default_value_t = 8)]
    pub multi_turn_conversations: usize,
    /// multi-turn: turns (requests) per conversation.
    #[arg(long, env = "PRISM_BENCH_MULTI_TURN_TURNS", default_value_t = 4)]
    pub multi_turn_turns: usize,
    /// multi-turn: words of the shared system prompt.
    #[arg(long, env = "PRISM_BENCH_MULTI_TURN_SYSTEM_LEN", default_value_t = 256)]
    pub multi_turn_system_len: usize,
    /// multi-turn: words of each user message.
    #[arg(long, env = "PRISM_BENCH_MULTI_TURN_USER_LEN", default_value_t = 64)]
    pub multi_turn_user_len: usize,
    /// multi-turn: max_tokens per turn, and words of each assistant reply in the history.
    #[arg(long, env = "PRISM_BENCH_MULTI_TURN_OUTPUT_LEN", default_value_t = 64)]
    pub multi_turn_output_len: u32,
    /// prefix_repetition: tokens of each shared prefix (words of the system message on chat).
    #[arg(long, env = "PRISM_BENCH_PREFIX_REPETITION_PREFIX_LEN", default_value_t = prefix_repetition::DEFAULT_PREFIX_LEN)]
    pub prefix_repetition_prefix_len: usize,
    /// prefix_repetition: tokens of each request's own suffix (words of the user turn on chat).
    #[arg(long, env = "PRISM_BENCH_PREFIX_REPETITION_SUFFIX_LEN", default_value_t = prefix_repetition::DEFAULT_SUFFIX_LEN)]
    pub prefix_repetition_suffix_len: usize,
    /// prefix_repetition: distinct prefixes; requests are spread evenly over them.
    #[arg(long, env = "PRISM_BENCH_PREFIX_REPETITION_NUM_PREFIXES", default_value_t = prefix_repetition::DEFAULT_NUM_PREFIXES)]
    pub prefix_repetition_num_prefixes: usize,
    /// prefix_repetition: max_tokens of every request.
    #[arg(long, env = "PRISM_BENCH_PREFIX_REPETITION_OUTPUT_LEN", default_value_t = prefix_repetition::DEFAULT_OUTPUT_LEN)]
    pub prefix_repetition_output_len: u32,
    /// custom: max_tokens of lines without `max_tokens` / `output_len`.
    #[arg(long, env = "PRISM_BENCH_CUSTOM_OUTPUT_LEN", default_value_t = 256)]
    pub custom_output_len: u32,

    /// Requests/s (gamma-distributed gaps, see --burstiness), or inf: all at once.
    #[arg(long, env = "PRISM_BENCH_REQUEST_RATE", default_value = "inf", value_parser = parse_rate)]
    pub request_rate: f64,
    /// Gamma shape of the gaps between requests: 1 = Poisson, < 1 burstier, > 1 steadier.
    #[arg(long, env = "PRISM_BENCH_BURSTINESS", default_value_t = 1.0)]
    pub burstiness: f64,
    /// Most requests in flight at once (the others wait); default: no cap.
    #[arg(long, visible_alias = "concurrency", env = "PRISM_BENCH_MAX_CONCURRENCY")]
    pub max_concurrency: Option<usize>,
    /// Ramp the rate from --ramp-up-start-rps to --ramp-up-end-rps over the run (replaces
    /// --request-rate): linear, exponential, or step (--ramp-up-steps levels).
    #[arg(long, value_enum, env = "PRISM_BENCH_RAMP_UP_STRATEGY", requires_all = ["ramp_up_start_rps", "ramp_up_end_rps"])]
    pub ramp_up_strategy: Option<RampUpStrategy>,
    /// Rate of the first request with a ramp (requests/s).
    #[arg(long, env = "PRISM_BENCH_RAMP_UP_START_RPS", requires = "ramp_up_strategy")]
    pub ramp_up_start_rps: Option<f64>,
    /// Rate of the last request with a ramp (requests/s).
    #[arg(long, env = "PRISM_BENCH_RAMP_UP_END_RPS", requires = "ramp_up_strategy")]
    pub ramp_up_end_rps: Option<f64>,
    /// Levels of `--ramp-up-strategy step`.
    #[arg(long, env = "PRISM_BENCH_RAMP_UP_STEPS", default_value_t = 4)]
    pub ramp_up_steps: usize,

    /// Keep generating past EOS, so every request generates exactly its max_tokens.
    #[arg(long, env = "PRISM_BENCH_IGNORE_EOS")]
    pub ignore_eos: bool,
    /// Sampling temperature of every request (0 = greedy).
    #[arg(long, env = "PRISM_BENCH_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,

    /// Metrics whose percentiles are reported, comma-separated: ttft, tpot, itl, e2el.
    #[arg(long, env = "PRISM_BENCH_PERCENTILE_METRICS", default_value = "ttft,tpot,itl,e2el")]
    pub percentile_metrics: String,
    /// Percentiles to report, comma-separated (e.g. 50,90,99).
    #[arg(long, env = "PRISM_BENCH_METRIC_PERCENTILES", default_value = "50,90,99")]
    pub metric_percentiles: String,
    /// Service-level objectives in ms (`ttft:200 tpot:30`, also e2el); reports the goodput,
    /// completed requests/s that meet all of them.
    #[arg(long, num_args = 1.., env = "PRISM_BENCH_GOODPUT", value_delimiter = ' ')]
    pub goodput: Vec<String>,

    /// A worker's Prometheus endpoint (`http://HOST:PORT/metrics`), scraped before and after the
    /// run for its requests and prefix-cache counters; repeat it for each worker.
    #[arg(long = "metrics-url", env = "PRISM_BENCH_METRICS_URL", value_delimiter = ',')]
    pub metrics_urls: Vec<String>,

    /// Write the JSON result (to --result-dir/--result-filename).
    #[arg(long, env = "PRISM_BENCH_SAVE_RESULT")]
    pub save_result: bool,
    /// Also write per-request input/output lengths, TTFTs, ITLs, E2E latencies and errors.
    #[arg(long, env = "PRISM_BENCH_SAVE_DETAILED")]
    pub save_detailed: bool,
    /// Directory of the result file (default: the current directory).
    #[arg(long, env = "PRISM_BENCH_RESULT_DIR")]
    pub result_dir: Option<PathBuf>,
    /// File name of the result (default: prism-BACKEND-RATEqps-concurrencyN-DATE.json).
    #[arg(long, env = "PRISM_BENCH_RESULT_FILENAME")]
    pub result_filename: Option<String>,
    /// Full path of the JSON result (implies --save-result).
    #[arg(long, env = "PRISM_BENCH_RESULT_FILE")]
    pub result_file: Option<PathBuf>,
    /// A label stored in the result file.
    #[arg(long, env = "PRISM_BENCH_LABEL")]
    pub label: Option<String>,
    /// No progress bar on stderr (it is also hidden when stderr is not a terminal).
    #[arg(long, visible_alias = "disable-tqdm", env = "PRISM_BENCH_NO_PROGRESS")]
    pub no_progress: bool,
}

impl ServeArgs {
    /// Where requests go, with the router address of the global `--router` flag.
    pub fn target(&self, router: &crate::client::RouterTarget) -> Target {
        Target {
            backend: self.backend,
            router: router.clone(),
            base_url: self.base_url.clone(),
            endpoint: self.endpoint.clone(),
            api_key: self.api_key(),
        }
    }

    /// The key requests carry: the first of a comma-separated `--api-key` / `PRISM_API_KEY`.
    pub fn api_key(&self) -> Option<String> {
        self.api_key.as_deref().and_then(crate::client::first_api_key).map(str::to_owned)
    }

    /// The arrival process.
    ///
    /// # Errors
    /// Invalid rates, shape or steps.
    pub fn schedule(&self) -> anyhow::Result<Schedule> {
        let ramp = self.ramp_up_strategy.map(|strategy| Ramp {
            strategy,
            start_rps: self.ramp_up_start_rps.unwrap_or(0.0),
            end_rps: self.ramp_up_end_rps.unwrap_or(0.0),
            steps: self.ramp_up_steps,
        });
        let s = Schedule { rate: self.request_rate, burstiness: self.burstiness, ramp };
        s.validate()?;
        Ok(s)
    }

    /// The requests of the run, `--num-prompts` of them when given.
    ///
    /// # Errors
    /// Invalid dataset flags, or a bad JSONL file (naming the line).
    pub fn dataset(&self, rng: &mut StdRng) -> Result<Vec<BenchRequest>, DatasetError> {
        if self.num_prompts == Some(0) {
            return Err(DatasetError::Invalid("--num-prompts must be at least 1".into()));
        }
        let requests = match self.dataset_name {
            DatasetName::Random => {
                let cfg = RandomConfig {
                    input_len: self.random_input_len,
                    output_len: self.random_output_len,
                    range_ratio: self.random_range_ratio,
                    prefix_len: self.random_prefix_len,
                    vocab_size: self.random_vocab_size,
                };
                return dataset::random(&cfg, self.num_prompts.unwrap_or(1000), rng);
            }
            DatasetName::PrefixRepetition => {
                let cfg = PrefixRepetitionConfig {
                    prefix_len: self.prefix_repetition_prefix_len,
                    suffix_len: self.prefix_repetition_suffix_len,
                    num_prefixes: self.prefix_repetition_num_prefixes,
                    output_len: self.prefix_repetition_output_len,
                    vocab_size: self.random_vocab_size,
                };
                // Chat carries text: the prefix becomes the system message.
                let form = if self.backend == Backend::OpenaiChat { PrefixForm::Chat } else { PrefixForm::TokenIds };
                return prefix_repetition::prefix_repetition(&cfg, form, self.num_prompts.unwrap_or(1000), rng);
            }
            DatasetName::MultiTurn => dataset::multi_turn(
                &MultiTurnConfig {
                    conversations: self.multi_turn_conversations,
                    turns: self.multi_turn_turns,
                    system_len: self.multi_turn_system_len,
                    user_len: self.multi_turn_user_len,
                    output_len: self.multi_turn_output_len,
                },
                rng,
            )?,
            DatasetName::Custom => {
                let Some(path) = &self.dataset_path else {
                    return Err(DatasetError::Invalid("--dataset-name custom needs --dataset-path FILE.jsonl".into()));
                };
                if self.custom_output_len == 0 {
                    return Err(DatasetError::Invalid("--custom-output-len must be at least 1".into()));
                }
                dataset::read_jsonl(path, self.custom_output_len)?
            }
        };
        let n = self.num_prompts.unwrap_or(requests.len());
        Ok(dataset::fit(requests, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.serve)
    }

    #[test]
    fn vllm_flag_names_and_old_aliases() {
        let a = parse(&[
            "--backend",
            "openai-chat",
            "--dataset-name",
            "multi-turn",
            "--request-rate",
            "2.5",
            "--burstiness",
            "0.5",
            "--max-concurrency",
            "4",
            "--goodput",
            "ttft:200",
            "tpot:30",
            "--ignore-eos",
            "--seed",
            "3",
        ])
        .unwrap();
        assert_eq!(a.backend, Backend::OpenaiChat);
        assert_eq!(a.dataset_name, DatasetName::MultiTurn);
        assert_eq!((a.request_rate, a.burstiness, a.max_concurrency), (2.5, 0.5, Some(4)));
        assert_eq!(a.goodput, vec!["ttft:200".to_owned(), "tpot:30".to_owned()]);
        assert!(a.ignore_eos);
        let old = parse(&["--concurrency", "8", "--requests", "64"]).unwrap();
        assert_eq!((old.max_concurrency, old.num_prompts), (Some(8), Some(64)));
        assert_eq!(old.request_rate, f64::INFINITY);
        assert_eq!(parse(&["--dataset-name", "jsonl"]).unwrap().dataset_name, DatasetName::Custom);
        assert!(parse(&["--request-rate", "0"]).is_err());
        assert!(parse(&["--ramp-up-strategy", "linear"]).is_err(), "a ramp needs start and end rates");
        let ramp =
            parse(&["--ramp-up-strategy", "step", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4"]).unwrap();
        assert_eq!(ramp.schedule().unwrap().ramp.unwrap().strategy, RampUpStrategy::Step);
    }

    #[test]
    fn dataset_sizes() {
        let mut rng = rand::SeedableRng::seed_from_u64(0);
        let a = parse(&["--num-prompts", "5", "--random-input-len", "4", "--random-output-len", "2"]).unwrap();
        assert_eq!(a.dataset(&mut rng).unwrap().len(), 5);
        let mt = parse(&["--dataset-name", "multi-turn", "--multi-turn-conversations", "3", "--multi-turn-turns", "2"])
            .unwrap();
        assert_eq!(mt.dataset(&mut rng).unwrap().len(), 6);
        assert!(matches!(
            parse(&["--dataset-name", "custom"]).unwrap().dataset(&mut rng),
            Err(DatasetError::Invalid(_))
        ));
        assert!(matches!(parse(&["--num-prompts", "0"]).unwrap().dataset(&mut rng), Err(DatasetError::Invalid(_))));
    }

    #[test]
    fn prefix_repetition_flags_and_form_by_backend() {
        let mut rng = rand::SeedableRng::seed_from_u64(0);
        let d = parse(&["--dataset-name", "prefix_repetition"]).unwrap();
        assert_eq!(d.dataset_name, DatasetName::PrefixRepetition);
        assert_eq!((d.prefix_repetition_prefix_len, d.prefix_repetition_suffix_len), (256, 256), "vLLM's defaults");
        assert_eq!((d.prefix_repetition_num_prefixes, d.prefix_repetition_output_len), (10, 128));
        let flags = [
            "--dataset-name",
            "prefix-repetition",
            "--prefix-repetition-prefix-len",
            "20",
            "--prefix-repetition-suffix-len",
            "4",
            "--prefix-repetition-num-prefixes",
            "1",
            "--prefix-repetition-output-len",
            "8",
            "--num-prompts",
            "3",
        ];
        let ids = parse(&flags).unwrap().dataset(&mut rng).unwrap();
        assert_eq!(ids.len(), 3);
        assert!(ids.iter().all(|r| matches!(&r.prompt, dataset::Prompt::TokenIds(t) if t.len() == 24)));
        assert!(ids.iter().all(|r| r.output_len == 8));
        let chat_flags: Vec<&str> = ["--backend", "openai-chat"].iter().chain(flags.iter()).copied().collect();
        let chat = parse(&chat_flags).unwrap().dataset(&mut rng).unwrap();
        assert!(chat.iter().all(|r| matches!(&r.prompt, dataset::Prompt::Chat(m) if m[0].role == "system")));
        let too_few = parse(&["--dataset-name", "prefix_repetition", "--num-prompts", "5"]).unwrap();
        assert!(matches!(too_few.dataset(&mut rng), Err(DatasetError::Invalid(_))), "5 requests over 10 prefixes");
        let urls = parse(&["--metrics-url", "http://a/metrics", "--metrics-url", "http://b/metrics,http://c/metrics"])
            .unwrap()
            .metrics_urls;
        assert_eq!(urls, ["http://a/metrics", "http://b/metrics", "http://c/metrics"]);
    }
}
