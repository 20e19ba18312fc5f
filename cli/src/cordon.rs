//! `prism cordon NODE` / `prism uncordon NODE`: stop or resume placing replicas on a node
//! (running replicas stay, as with `kubectl cordon`).

use crate::client;
use anyhow::Result;
use prism_common::proto::v1::NodeRequest;

/// Cordons (`cordon = true`) or uncordons a node.
///
/// # Errors
/// Fails when the head is unreachable or does not know the node.
pub async fn run(head_addr: &client::HeadTarget, node: String, cordon: bool) -> Result<()> {
    let mut head = client::Head::connect(head_addr).await?;
    let request = NodeRequest { node_id: node.clone() };
    head.call(|mut h| {
        let request = request.clone();
        async move { if cordon { h.cordon_node(request).await } else { h.uncordon_node(request).await } }
    })
    .await?;
    println!("node {node} {}", if cordon { "cordoned" } else { "uncordoned" });
    Ok(())
}
