//! Choices the engine ends with finish reason `abort` (a request it drops: its deadline, the
//! replica stopping) never reach an OpenAI client as `"finish_reason": "abort"`, which is not
//! an OpenAI finish reason: a single-choice stream moves to another replica token-exact, and
//! one that cannot move ends with an error (non-streamed: the status; streamed: an error event
//! and `[DONE]`). The real router in front of `MockEngineWorker`s.

use prism_router::mock_engine::MockBehavior;
use prism_router::mock_router::MockRouter;
use serde_json::{Value, json};

/// The router in front of one mock replica of model `mock` per behaviour.
async fn cluster(behaviors: Vec<MockBehavior>) -> anyhow::Result<MockRouter> {
    MockRouter::start(behaviors, |_| {}).await
}

async fn post(c: &MockRouter, body: Value) -> anyhow::Result<(u16, String)> {
    let r = reqwest::Client::new().post(format!("{}/v1/completions", c.http)).json(&body).send().await?;
    Ok((r.status().as_u16(), r.text().await?))
}

fn aborting() -> MockBehavior {
    MockBehavior { abort_after_tokens: Some(3), ..Default::default() }
}

#[tokio::test]
async fn an_aborted_single_choice_stream_moves_token_exact() -> anyhow::Result<()> {
    let c = cluster(vec![aborting(), MockBehavior::default()]).await?;
    // P2C picks either replica while both are idle; 12 tries miss the aborting one with p = 1/4096.
    for _ in 0..12 {
        let body = json!({"model": "mock", "prompt": "a b", "max_tokens": 10, "stream": true});
        let (s, text) = post(&c, body).await?;
        assert_eq!(s, 200, "{text}");
        assert!(!text.contains("\"abort\"") && !text.contains("\"error\""), "{text}");
        let out: String = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(out, (0..10).map(|i| format!("t{i} ")).collect::<String>());
    }
    Ok(())
}

#[tokio::test]
async fn an_abort_that_cannot_move_is_an_error_not_a_finish_reason() -> anyhow::Result<()> {
    // Two choices: a stream of several choices never moves (one choice would wait for another
    // replica to continue on). Non-streamed: the status of the request.
    let c = cluster(vec![aborting()]).await?;
    let (s, body) = post(&c, json!({"model": "mock", "prompt": "a b", "max_tokens": 10, "n": 2})).await?;
    assert_eq!(s, 503, "{body}");
    assert!(!body.contains("\"abort\""), "{body}");
    // Streamed: an error event, then `[DONE]`.
    let c = cluster(vec![aborting()]).await?;
    let (s, text) =
        post(&c, json!({"model": "mock", "prompt": "a b", "max_tokens": 10, "n": 2, "stream": true})).await?;
    assert_eq!(s, 200, "{text}");
    assert!(!text.contains("\"abort\""), "{text}");
    assert!(text.contains("\"error\"") && text.ends_with("data: [DONE]\n\n"), "{text}");
    Ok(())
}
