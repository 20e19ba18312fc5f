//! [`Deployment`]: the deployment file (`prism deploy -f FILE`) a cluster test applies.

use crate::client::SERVED;
use std::path::{Path, PathBuf};

/// A deployment of one model, written as the YAML that `prism deploy -f` reads.
#[derive(Clone, Debug)]
pub struct Deployment {
    /// Deployment name (`smollm2` unless set).
    pub name: String,
    /// Model file or directory.
    pub model: PathBuf,
    /// Name clients request (`served_model_name`; [`SERVED`] unless set).
    pub served_model_name: String,
    /// Replica count (with `autoscaling`, the count it starts at: what `start` waits for).
    pub replicas: u32,
    /// Placement strategy (`spread` unless set).
    pub placement: String,
    /// Engine settings (`engine:` keys such as `max_num_seqs`), in order.
    pub engine: Vec<(String, String)>,
    /// `autoscaling_config:` keys (Ray Serve's names), in order; empty = a fixed `replicas`.
    pub autoscaling: Vec<(String, String)>,
}

impl Deployment {
    /// One replica of `model` named `smollm2`, served as [`SERVED`], spread.
    pub fn new(model: &Path) -> Self {
        Self {
            name: "smollm2".to_owned(),
            model: model.to_path_buf(),
            served_model_name: SERVED.to_owned(),
            replicas: 1,
            placement: "spread".to_owned(),
            engine: Vec::new(),
            autoscaling: Vec::new(),
        }
    }

    /// The same autoscaled with `autoscaling_config` keys such as `("max_replicas", "3")`;
    /// it starts at `initial_replicas`, else `min_replicas`, else 0.
    #[must_use]
    pub fn autoscaling(mut self, keys: &[(&str, &str)]) -> Self {
        self.autoscaling = keys.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let get = |k: &str| self.autoscaling.iter().find(|(key, _)| key == k).and_then(|(_, v)| v.parse().ok());
        self.replicas = get("initial_replicas").or_else(|| get("min_replicas")).unwrap_or(0);
        self
    }

    /// The same with `replicas` replicas.
    #[must_use]
    pub fn replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }

    /// The same named `name` (several deployments in one cluster).
    #[must_use]
    pub fn named(mut self, name: &str) -> Self {
        name.clone_into(&mut self.name);
        self
    }

    /// The same served as `name`.
    #[must_use]
    pub fn served_as(mut self, name: &str) -> Self {
        name.clone_into(&mut self.served_model_name);
        self
    }

    /// The same with engine setting `key: value` added.
    #[must_use]
    pub fn engine(mut self, key: &str, value: impl ToString) -> Self {
        self.engine.push((key.to_owned(), value.to_string()));
        self
    }

    /// The deployment file.
    pub fn to_yaml(&self) -> String {
        let mut yaml = format!(
            "name: {}\nmodel: {}\nserved_model_name: {}\n",
            self.name,
            self.model.display(),
            self.served_model_name
        );
        if self.autoscaling.is_empty() {
            yaml.push_str(&format!("replicas: {}\n", self.replicas));
        } else {
            yaml.push_str("autoscaling_config:\n");
            for (k, v) in &self.autoscaling {
                yaml.push_str(&format!("  {k}: {v}\n"));
            }
        }
        yaml.push_str(&format!("placement: {}\n", self.placement));
        if !self.engine.is_empty() {
            yaml.push_str("engine:\n");
            for (k, v) in &self.engine {
                yaml.push_str(&format!("  {k}: {v}\n"));
            }
        }
        yaml
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_has_the_fields_prism_deploy_reads() {
        let d = Deployment::new(Path::new("/m/model.gguf")).replicas(2);
        assert_eq!(
            d.to_yaml(),
            "name: smollm2\nmodel: /m/model.gguf\nserved_model_name: smollm2\nreplicas: 2\nplacement: spread\n"
        );
        let d = d.served_as("Other").engine("max_num_seqs", 4).engine("max_num_batched_tokens", 32);
        let engine = "engine:\n  max_num_seqs: 4\n  max_num_batched_tokens: 32\n";
        let tail = format!("served_model_name: Other\nreplicas: 2\nplacement: spread\n{engine}");
        assert!(d.to_yaml().ends_with(&tail), "{}", d.to_yaml());
        let d = Deployment::new(Path::new("/m")).autoscaling(&[("min_replicas", "1"), ("max_replicas", "3")]);
        assert_eq!(d.replicas, 1);
        assert!(
            d.to_yaml().ends_with("autoscaling_config:\n  min_replicas: 1\n  max_replicas: 3\nplacement: spread\n"),
            "{}",
            d.to_yaml()
        );
        assert!(!d.to_yaml().contains("replicas: 1\nplacement"));
    }
}
