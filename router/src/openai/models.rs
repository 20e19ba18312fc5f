//! `GET /v1/models` and `GET /v1/models/{id}`: OpenAI's model objects for every served model
//! of the route table, also one with no Ready replica right now (scaled to zero, starting,
//! draining, failed): a request for it queues or gets 503, never 404.
//!
//! Each object carries vLLM's `max_model_len`, the largest context length its replicas
//! reported, else (no replica Ready: failed, scaled to 0, autoscaled at zero, loading) the
//! one its deployment's spec sets (`RouteTable.served`). A model with neither (its spec
//! leaves it to the model and the KV cache, and no replica reported it) has no such key at
//! all rather than `null`: OpenAI's model object has no such field, and an absent key says
//! "unknown" without a `null` that a client expecting a number would trip on.

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
        .keys()
        .map(|name| {
            let mut obj = json!({"id": name, "object": "model", "created": created, "owned_by": "prism",
                   "root": name, "parent": null});
            // 0 = unknown: no listed replica reported its context length and the spec sets none.
            let max_len = snap.max_model_len(name);
            if max_len > 0 {
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
    use prism_common::proto::v1::{
        ReplicaState, RouteEntry, RouteTable, ServedModel, UnavailableCause, UnavailableModel,
    };

    /// `ready` with one Ready replica that reported 2048 tokens (its spec says 4096: the
    /// engine's value wins), `loading` listed with no replica yet, `failed` named unavailable
    /// by the head, neither with a configured length; `zero` (an autoscaled model at zero)
    /// and `gone` (failed) with no replica and a configured length.
    fn snapshot() -> std::sync::Arc<RouteSnapshot> {
        let routes = Routes::new(256, Metrics::new());
        routes.apply(RouteTable {
            version: 1,
            term: 0,
            models: ["ready", "loading", "failed", "zero", "gone"].map(String::from).to_vec(),
            served: [("ready", 4096), ("loading", 0), ("failed", 0), ("zero", 1024), ("gone", 512)]
                .map(|(m, len)| ServedModel { model: m.into(), deployment: m.into(), max_model_len: len, codec_id: 1 })
                .to_vec(),
            routes: vec![RouteEntry {
                replica_id: "r0".into(),
                model: "ready".into(),
                endpoint: "http://r0".into(),
                state: ReplicaState::Ready as i32,
                max_model_len: 2048,
                ..Default::default()
            }],
            unavailable: ["failed", "gone"]
                .map(|m| UnavailableModel {
                    model: m.into(),
                    deployment: m.into(),
                    cause: UnavailableCause::Failed as i32,
                    reason: "no such file".into(),
                })
                .to_vec(),
        });
        routes.snapshot()
    }

    #[test]
    fn max_model_len_is_the_reported_else_the_configured_and_absent_when_neither() {
        let objects: std::collections::BTreeMap<String, Value> = objects(&snapshot(), 7).into_iter().collect();
        assert_eq!(objects.len(), 5, "every listed model, served or not: {objects:?}");
        assert_eq!(objects["ready"]["max_model_len"], json!(2048));
        assert_eq!(objects["zero"]["max_model_len"], json!(1024), "no replica: the spec's");
        assert_eq!(objects["gone"]["max_model_len"], json!(512), "failed: the spec's");
        for model in ["loading", "failed"] {
            let obj = objects[model].as_object().expect("an object");
            assert!(!obj.contains_key("max_model_len"), "{model}: {obj:?}");
            assert_eq!((obj["id"].as_str(), obj["created"].as_i64()), (Some(model), Some(7)));
        }
    }
}
