//! `GET /v1/models` and `GET /v1/models/{id}`: OpenAI's model objects for every served model
//! of the route table, also one with no Ready replica right now (scaled to zero, starting,
//! draining, failed): a request for it queues or gets 503, never 404.
//!
//! Each object carries vLLM's `max_model_len`, the largest context length its replicas
//! reported. A model none of whose listed replicas reported one (none Ready: failed, scaled
//! to 0, loading) has no such key at all rather than `null`: OpenAI's model object has no
//! such field, and an absent key says "unknown" without a `null` that a client expecting a
//! number would trip on.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::errors::ApiError;
use crate::dispatch::DispatchError;
use crate::routes::RouteSnapshot;

/// The model objects of `snap`'s models, by served name; `created` is the router's start
/// (Unix seconds).
fn objects(snap: &RouteSnapshot, created: i64) -> Vec<(String, Value)> {
    snap.models
        .iter()
        .map(|(name, rs)| {
            let mut obj = json!({"id": name, "object": "model", "created": created, "owned_by": "prism",
                   "root": name, "parent": null});
            // 0 = unknown: no listed replica reported its context length.
            if let Some(max_len) = rs.iter().map(|r| r.max_model_len).max().filter(|&n| n > 0) {
                obj["max_model_len"] = json!(max_len);
            }
            (name.clone(), obj)
        })
        .collect()
}

/// `GET /v1/models` over the route table `snap`; 503 before the first table (an empty list
/// would say that no model exists).
pub fn list(snap: &RouteSnapshot, created: i64) -> Response {
    if !snap.loaded {
        return ApiError::from(DispatchError::NoRouteTable).into_response();
    }
    let data: Vec<Value> = objects(snap, created).into_iter().map(|(_, v)| v).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}` over `snap`: the model object, 404 when no such model is listed, 503
/// before the first table.
pub fn one(snap: &RouteSnapshot, created: i64, id: &str) -> Response {
    if !snap.loaded {
        return ApiError::from(DispatchError::NoRouteTable).into_response();
    }
    match objects(snap, created).into_iter().find(|(name, _)| name == id) {
        Some((_, v)) => axum::Json(v).into_response(),
        None => ApiError {
            param: Some("model".into()),
            ..ApiError::new(StatusCode::NOT_FOUND, format!("the model `{id}` does not exist"))
        }
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::routes::Routes;
    use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable, UnavailableCause, UnavailableModel};

    /// `ready` with one Ready replica that reported 2048 tokens, `loading` listed with no
    /// replica yet, `failed` named unavailable by the head.
    fn snapshot() -> std::sync::Arc<RouteSnapshot> {
        let routes = Routes::new(256, Metrics::new());
        routes.apply(RouteTable {
            served: vec![],
            version: 1,
            term: 0,
            models: vec!["ready".into(), "loading".into(), "failed".into()],
            routes: vec![RouteEntry {
                replica_id: "r0".into(),
                model: "ready".into(),
                endpoint: "http://r0".into(),
                state: ReplicaState::Ready as i32,
                max_model_len: 2048,
                ..Default::default()
            }],
            unavailable: vec![UnavailableModel {
                model: "failed".into(),
                deployment: "failed".into(),
                cause: UnavailableCause::Failed as i32,
                reason: "no such file".into(),
            }],
        });
        routes.snapshot()
    }

    #[test]
    fn max_model_len_is_shown_when_reported_and_absent_otherwise() {
        let objects: std::collections::BTreeMap<String, Value> = objects(&snapshot(), 7).into_iter().collect();
        assert_eq!(objects.len(), 3, "every listed model, served or not: {objects:?}");
        assert_eq!(objects["ready"]["max_model_len"], json!(2048));
        for model in ["loading", "failed"] {
            let obj = objects[model].as_object().expect("an object");
            assert!(!obj.contains_key("max_model_len"), "{model}: {obj:?}");
            assert_eq!((obj["id"].as_str(), obj["created"].as_i64()), (Some(model), Some(7)));
        }
    }
}
