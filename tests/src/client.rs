//! Clients of a running cluster: greedy gRPC streams through the router with their timing
//! ([`stream`]), closed-loop load checked token by token against an undisturbed run
//! ([`Load`]), OpenAI HTTP calls ([`post_json`], [`post_sse`]), and the greedy reference
//! fixture of the bundled model ([`check_reference_greedy`]).

mod generate;
mod load;
mod openai;
mod reference;

pub use generate::{
    PROMPTS, SERVED, StreamResult, greedy_request, reference, router_ready_replicas, stream, stream_counted,
    wait_route_change,
};
pub use load::{Load, LoadReport};
pub use openai::{check_models, post_json, post_sse};
pub use reference::{ReferenceCase, check_reference_greedy, reference_cases};
