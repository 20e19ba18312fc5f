//! Newtype identifiers used across components. All are cheap to clone strings on the wire.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub String);

        impl $name {
            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s)
            }
        }
        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }
    };
}

string_id!(
    /// A worker node (one `prism-worker` process), e.g. the pod name.
    NodeId
);
string_id!(
    /// One replica of a deployment: a GPU group of `tensor_parallel_size` shards.
    ReplicaId
);
string_id!(
    /// One client request, carried from router to worker and engine.
    RequestId
);
string_id!(
    /// A deployment's name (DNS-1123 label).
    DeploymentName
);

impl ReplicaId {
    /// A fresh replica id `{deployment}-{8 hex chars}`.
    pub fn new_for(deployment: &DeploymentName) -> Self {
        let u = uuid::Uuid::new_v4().simple().to_string();
        Self(format!("{}-{}", deployment.0, &u[..8]))
    }
}

impl RequestId {
    /// A fresh random request id (UUID v4).
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }
}
