//! `prism scale NAME N`: sets a deployment's replica count. `prism delete NAME`: removes a
//! deployment (its replicas drain and stop; the router stops listing its model).

use crate::client::{self, status_error};
use anyhow::Result;
use clap::Args;
use prism_common::proto::v1::{DeleteDeploymentRequest, ScaleDeploymentRequest};

/// `prism scale` arguments.
#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// Deployment name.
    pub name: String,
    /// Desired number of replicas.
    pub replicas: u32,
}

/// Runs `prism scale`.
///
/// # Errors
/// Fails when the head is unreachable or rejects the request (unknown deployment, …).
pub async fn run(head_addr: &client::HeadTarget, args: ScaleArgs) -> Result<()> {
    let mut head = client::head(head_addr).await?;
    head.scale_deployment(ScaleDeploymentRequest { name: args.name.clone(), replicas: args.replicas })
        .await
        .map_err(status_error)?;
    println!("deployment {} scaled to {} replicas", args.name, args.replicas);
    Ok(())
}

/// Runs `prism delete NAME`.
///
/// # Errors
/// Fails when the head is unreachable or rejects the request (unknown deployment, …).
pub async fn delete(head_addr: &client::HeadTarget, name: String) -> Result<()> {
    let mut head = client::head(head_addr).await?;
    head.delete_deployment(DeleteDeploymentRequest { name: name.clone() }).await.map_err(status_error)?;
    println!("deployment {name} deleted; its replicas drain and stop");
    Ok(())
}
