//! Placement: the pure [`planner`] and [`autoscaler`] decisions, and the level-triggered
//! [`reconciler`] that applies them to the state store and the workers.

pub mod autoscaler;
pub mod planner;
pub mod reconciler;
