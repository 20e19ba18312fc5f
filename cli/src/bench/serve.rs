//! `prism bench serve`: builds the dataset and the arrival times from `--seed`, sends each
//! request at its time (a task per request; with `--max-concurrency` the task first waits
//! for one of that many permits, so arrivals keep their schedule and wait client-side, as in
//! vLLM), then prints the table and writes the JSON result. The benchmark's duration runs
//! from the first send to the last response. With `--metrics-url`, each worker's counters are
//! scraped before the first send and after the last response (`worker_metrics.rs`).
//!
//! The progress bar is indicatif's (already the CLI's bar for `prism up`): it redraws at a
//! bounded rate from any task through a cheap clone, and is hidden when stderr is not a
//! terminal or with `--no-progress`, so scripted runs get clean output.

use super::args::ServeArgs;
use super::report::{self, RunInfo};
use super::stats::{self, Failure, Metric, Record, Slo};
use super::transport::Client;
use super::transport::stream::RequestOptions;
use super::worker_metrics;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Semaphore;

fn progress(n: usize, hidden: bool) -> ProgressBar {
    if hidden || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Runs `prism bench serve` (`router`: the global `--router` gRPC address).
///
/// # Errors
/// Invalid flags or dataset, an unreachable server, a result file that cannot be written, or
/// a run in which every request failed.
pub async fn run(router: &crate::client::RouterTarget, args: ServeArgs) -> Result<()> {
    let metrics = Metric::parse_list(&args.percentile_metrics)?;
    let percentiles = stats::parse_percentiles(&args.metric_percentiles)?;
    let slo = if args.goodput.is_empty() { None } else { Some(Slo::parse(&args.goodput)?) };
    let schedule = args.schedule()?;
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be at least 1");
    }
    let mut rng = StdRng::seed_from_u64(args.seed);
    let requests = args.dataset(&mut rng)?;
    if let Some(bad) = requests.iter().find_map(|r| args.backend.accepts(&r.prompt).err()) {
        bail!("--dataset-name {} with --backend {}: {bad}", args.dataset_name.name(), args.backend.name());
    }
    let offsets = schedule.offsets(requests.len(), &mut rng);

    let client = Client::connect(&args.target(router)).await?;
    let model = client.resolve_model(args.model.clone()).await?;
    let opts = Arc::new(RequestOptions {
        model: model.clone(),
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
        api_key: args.api_key(),
    });
    let info = RunInfo {
        backend: args.backend.name(),
        model,
        dataset: args.dataset_name.name(),
        num_prompts: requests.len(),
        request_rate: schedule.rate,
        burstiness: schedule.burstiness,
        max_concurrency: args.max_concurrency,
        ramp: schedule.ramp.map(|r| (r.strategy.name(), r.start_rps, r.end_rps)),
        seed: args.seed,
        goodput: slo.iter().flat_map(|s| s.limits_ms.iter().map(|(m, v)| (m.key(), *v))).collect(),
        label: args.label.clone(),
        started_unix_s: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    };

    let scraper = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let before = worker_metrics::scrape_all(&scraper, &args.metrics_urls).await?;

    let bar = progress(requests.len(), args.no_progress);
    let permits = args.max_concurrency.map(|c| Arc::new(Semaphore::new(c)));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (request, offset) in requests.into_iter().zip(offsets) {
        tokio::time::sleep_until((started + Duration::from_secs_f64(offset)).into()).await;
        let (client, opts, permits, bar) = (client.clone(), opts.clone(), permits.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = match &permits {
                Some(p) => Some(p.clone().acquire_owned().await),
                None => None,
            };
            let outcome = client.send(&opts, &request).await;
            bar.inc(1);
            outcome
        }));
    }
    let mut records: Vec<Record> = Vec::new();
    let mut failures: Vec<Failure> = Vec::new();
    for task in tasks {
        match task.await.context("benchmark request task panicked")? {
            Ok(r) => records.push(r),
            Err(f) => {
                failures.push(f);
                bar.set_message(format!("({} failed)", failures.len()));
            }
        }
    }
    let duration = started.elapsed();
    bar.finish_and_clear();

    let workers = if args.metrics_urls.is_empty() {
        None
    } else {
        let wait = Duration::from_secs(3);
        match worker_metrics::after_run(&scraper, &args.metrics_urls, &before, records.len(), wait).await {
            Ok(load) => Some(load),
            Err(e) => {
                eprintln!("worker metrics after the run: {e:#}");
                None
            }
        }
    };

    let agg = stats::aggregate(&records, &failures, duration, slo.as_ref(), &percentiles);
    print!("{}", report::table(&info, &agg, &metrics));
    if let Some(w) = &workers {
        print!("{}", w.table());
    }
    let path = match (&args.result_file, args.save_result) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => {
            let name = args.result_filename.clone().unwrap_or_else(|| report::default_filename(&info));
            Some(args.result_dir.clone().unwrap_or_default().join(name))
        }
        (None, false) => None,
    };
    if let Some(path) = path {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut value = report::json(&info, &agg, &records, &failures, args.save_detailed);
        if !args.metrics_urls.is_empty() {
            value["workers"] = workers.as_ref().map_or(serde_json::Value::Null, worker_metrics::WorkerLoad::json);
        }
        let text = serde_json::to_string_pretty(&value)?;
        std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        println!("result written to {}", path.display());
    }
    if let Some(f) = failures.first() {
        eprintln!("first error ({}): {}", f.status, f.message);
    }
    if records.is_empty() {
        bail!("every request failed");
    }
    Ok(())
}
