//! Placement: the pure [`planner`] and the level-triggered [`reconciler`] that applies
//! its actions to the state store and the workers.

pub mod planner;
pub mod reconciler;
