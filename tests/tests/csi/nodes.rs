//! Two nodes' drivers side by side: each provisions only its own volumes.

use super::{ensure, kubelet, Pair, Result, MIB};

/// Two nodes in one guest, each a ublkd and a ublkd-csi of its own: each provisions only its
/// own volumes, topology is honoured, capacity is per node, and a full node says
/// RESOURCE_EXHAUSTED (so the scheduler tries another).
#[tokio::test]
async fn two_nodes_provision_only_their_own_volumes() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec;
    let a = Pair::start("csi-node-a", 9565, "node-a").await?;
    // Node b takes one volume in all.
    let b = Pair::start_with("csi-node-b", 9566, "node-b", "[limits]\nmax_volumes = 1\n").await?;
    let (mut ca, _) = clients(&a).await?;
    let (mut cb, mut nb) = clients(&b).await?;
    let topo = |node: &str| spec::Topology {
        segments: [("ublkd.io/node".to_owned(), node.to_owned())].into(),
    };
    let params = vec![("backend", "ram".to_owned())];
    let with_topology = |name: &str, node: &str| {
        let mut r = create(name, 16 * MIB, &params, mount_cap("ext4"));
        r.accessibility_requirements = Some(spec::TopologyRequirement {
            requisite: vec![topo(node)],
            preferred: vec![topo(node)],
        });
        r
    };
    let e = ca
        .create_volume(with_topology("pvc-for-b", "node-b"))
        .await
        .expect_err("node a refuses a volume meant for node b");
    ensure!(e.code() == tonic::Code::ResourceExhausted, "{e:?}");
    ca.create_volume(with_topology("pvc-a1", "node-a")).await?;
    cb.create_volume(with_topology("pvc-b1", "node-b")).await?;
    let ids =
        |p: &Pair| -> Result<String> { p.daemon.ublkctl_ok(&["list-volumes", "--no-headers"]) };
    let (la, lb) = (ids(&a)?, ids(&b)?);
    ensure!(
        la.contains("pvc-a1") && !la.contains("pvc-b1"),
        "node a: {la}"
    );
    ensure!(
        lb.contains("pvc-b1") && !lb.contains("pvc-a1"),
        "node b: {lb}"
    );

    let cap_of = |p: &'static str| spec::GetCapacityRequest {
        parameters: [("backend".to_owned(), p.to_owned())].into(),
        ..Default::default()
    };
    let cap_a = ca.get_capacity(cap_of("ram")).await?.into_inner();
    let cap_b = cb.get_capacity(cap_of("ram")).await?.into_inner();
    println!("capacity: node a {cap_a:?}, node b {cap_b:?}");
    ensure!(cap_a.available_capacity > 0, "node a has room");
    ensure!(cap_b.available_capacity == 0, "node b is full: {cap_b:?}");
    // Capacity asked for another node's topology is none.
    let mut other = cap_of("ram");
    other.accessible_topology = Some(topo("node-b"));
    ensure!(
        ca.get_capacity(other)
            .await?
            .into_inner()
            .available_capacity
            == 0
    );
    let e = cb
        .create_volume(with_topology("pvc-b2", "node-b"))
        .await
        .expect_err("node b is full");
    ensure!(e.code() == tonic::Code::ResourceExhausted, "{e:?}");

    let info = nb
        .node_get_info(spec::NodeGetInfoRequest {})
        .await?
        .into_inner();
    ensure!(
        info.node_id == "node-b" && info.max_volumes_per_node == 1,
        "{info:?}"
    );
    ensure!(info.accessible_topology == Some(topo("node-b")), "{info:?}");
    for (c, id) in [(&mut ca, "pvc-a1"), (&mut cb, "pvc-b1")] {
        c.delete_volume(spec::DeleteVolumeRequest {
            volume_id: id.into(),
            secrets: Default::default(),
        })
        .await?;
    }
    Ok(())
}
