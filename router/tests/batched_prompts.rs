//! Batched completion prompts (`"prompt": ["A", "B"]`) through the real router in front of
//! `MockEngineWorker`s: each prompt is admitted as a request of its own, a prompt a worker
//! refuses fails the whole batch naming it, a failure after the stream started ends it with
//! an error event, and whenever the batch ends early (an error, the client gone) every other
//! prompt's generation is cancelled on its worker.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prism_router::config::RouterConfig;
use prism_router::mock_engine::MockBehavior;
use prism_router::mock_router::MockRouter;
use serde_json::{Value, json};

/// The router in front of one mock replica of model `mock`.
async fn router(behavior: MockBehavior, tweak: impl FnOnce(&mut RouterConfig)) -> anyhow::Result<MockRouter> {
    MockRouter::start(vec![behavior], tweak).await
}

async fn post(r: &MockRouter, body: &Value) -> anyhow::Result<(u16, Value)> {
    let resp = reqwest::Client::new().post(format!("{}/v1/completions", r.http)).json(body).send().await?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

/// Waits until the mock has no stream open (every generation ended or was cancelled).
async fn idle(r: &MockRouter) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.mocks[0].stats.active.load(Ordering::SeqCst) > 0 {
        assert!(Instant::now() < deadline, "streams still open on the worker");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Batch and prompt-count limits: more prompts than `--max-prompts-per-request` is a 400 with
/// nothing dispatched; a batch takes one slot per prompt, so with no queue a batch of three
/// on a replica taking two is refused (429) while a batch of two is served.
#[tokio::test]
async fn batches_are_capped_and_admitted_prompt_by_prompt() -> anyhow::Result<()> {
    let slow = MockBehavior { token_delay: Duration::from_millis(30), ..Default::default() };
    let r = router(slow, |cfg| {
        cfg.max_prompts_per_request = 3;
        cfg.max_in_flight_per_replica = 2;
        cfg.max_queued_requests = 0;
    })
    .await?;
    let (s, v) = post(&r, &json!({"model": "mock", "prompt": ["a", "b", "c", "d"], "max_tokens": 2})).await?;
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");
    assert_eq!(r.mocks[0].stats.requests.load(Ordering::SeqCst), 0, "nothing dispatched");

    let (s, v) = post(&r, &json!({"model": "mock", "prompt": ["a", "b", "c"], "max_tokens": 5})).await?;
    assert_eq!(s, 429, "three prompts, two slots, no queue: {v}");
    idle(&r).await;
    let (s, v) = post(&r, &json!({"model": "mock", "prompt": ["a", "b"], "max_tokens": 5, "n": 2})).await?;
    assert_eq!(s, 200, "{v}");
    let indexes: Vec<u64> = v["choices"].as_array().into_iter().flatten().filter_map(|c| c["index"].as_u64()).collect();
    assert_eq!(indexes, vec![0, 1, 2, 3]);
    Ok(())
}

/// A prompt the worker refuses (over its context: the router has no tokenizer for the mock,
/// so the worker's check is the one) fails the batch with a 400 naming that prompt, and the
/// other prompts' generations are cancelled.
#[tokio::test]
async fn a_refused_prompt_fails_the_batch_and_cancels_the_others() -> anyhow::Result<()> {
    let b = MockBehavior { token_delay: Duration::from_millis(20), max_model_len: Some(50), ..Default::default() };
    let r = router(b, |_| {}).await?;
    let long = "w ".repeat(60);
    for (round, stream) in [false, true].into_iter().enumerate() {
        let body = json!({"model": "mock", "prompt": ["a", long, "b"], "max_tokens": 40, "stream": stream});
        let (s, v) = post(&r, &body).await?;
        assert_eq!((s, v["error"]["param"].as_str()), (400, Some("prompt")), "stream {stream}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.starts_with("prompt[1]: "), "{message}");
        // Prompts 0 and 2 would generate for 800 ms: they are cancelled instead.
        idle(&r).await;
        assert_eq!(r.mocks[0].stats.cancelled.load(Ordering::SeqCst), 2 * (round as u64 + 1));
    }
    Ok(())
}

/// A generation failing after the stream started ends it with one error event and one
/// `[DONE]`; the other prompts' generations are cancelled.
#[tokio::test]
async fn a_failure_after_the_start_ends_the_stream_with_an_error_event() -> anyhow::Result<()> {
    // n = 2: a stream of several choices is not migrated, its failure reaches the client.
    let b = MockBehavior { fail_after_tokens: Some(3), ..Default::default() };
    let r = router(b, |_| {}).await?;
    let body = json!({"model": "mock", "prompt": ["a", "b"], "max_tokens": 20, "n": 2, "stream": true});
    let resp = reqwest::Client::new().post(format!("{}/v1/completions", r.http)).json(&body).send().await?;
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await?;
    let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    assert_eq!(events.iter().filter(|e| **e == "[DONE]").count(), 1, "{text}");
    let error: Value = serde_json::from_str(events[events.len() - 2])?;
    assert!(error["error"].is_object(), "an error event before [DONE]: {text}");
    idle(&r).await;
    Ok(())
}

/// A client that leaves mid-stream cancels every prompt's generation.
#[tokio::test]
async fn a_client_leaving_cancels_every_prompt() -> anyhow::Result<()> {
    let b = MockBehavior { token_delay: Duration::from_millis(50), ..Default::default() };
    let r = router(b, |_| {}).await?;
    let body = json!({"model": "mock", "prompt": ["a", "b", "c"], "max_tokens": 200, "stream": true});
    let mut resp = reqwest::Client::new().post(format!("{}/v1/completions", r.http)).json(&body).send().await?;
    assert_eq!(resp.status().as_u16(), 200);
    let first = resp.chunk().await?;
    assert!(first.is_some_and(|c| !c.is_empty()));
    assert_eq!(r.mocks[0].stats.active.load(Ordering::SeqCst), 3, "every prompt started");
    drop(resp);
    idle(&r).await;
    assert_eq!(r.mocks[0].stats.cancelled.load(Ordering::SeqCst), 3);
    Ok(())
}
