//! ublkd-csi: the Kubernetes CSI driver for ublkd volumes.
//!
//! One `ublkd-csi` runs on every node next to that node's ublkd, in its own pod (its own mount
//! namespace: the process serving a ublk device must not share one with the device's mounts).
//! Kubernetes is the distributed engine: external-provisioner in `--node-deployment` mode asks
//! each node's driver for that node's volumes, and topology and capacity steer the scheduler.
//! The driver keeps no volume state of its own: ublkd's registry is the truth, reached through
//! ublkd's gRPC API (`ublkd-client`) on the node's socket. Snapshots and clones stay on their
//! node too (csi-snapshotter `--node-deployment`); only ControllerModifyVolume comes from a
//! central sidecar, the csi-resizer, whose driver reaches the nodes' ublkd remotely (`modify`).
// Unsafe code only in the `sys` module, each block with its SAFETY comment.
#![deny(unsafe_code)]

/// The CSI v1 wire format, compiled from the project's own declaration `proto/csi_v1.proto`.
pub mod spec {
    #![allow(missing_docs, clippy::all, missing_debug_implementations)]
    tonic::include_proto!("csi.v1");
}

pub mod caps;
pub mod controller;
pub mod crypt;
pub mod ctl;
pub mod error;
pub mod faults;
pub mod identity;
pub mod modify;
pub mod mount;
pub mod naming;
pub mod node;
pub mod nodeloss;
pub mod nodestatus;
pub mod page;
pub mod params;
pub mod pvlimits;
pub mod pvreport;
pub mod qos;
pub mod resizer;
pub mod size;
pub mod snapshot;
#[allow(unsafe_code)]
pub mod sys;
pub mod ublkd;
pub mod watch;

/// This node's name: the value of the topology key, and the CSI node id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node(pub String);

/// The driver's name, as StorageClasses and the CSIDriver object name it.
pub const DRIVER_NAME: &str = "ublkd.io";

/// The topology key: the node a volume lives on (its data never leaves that node).
pub const TOPOLOGY_KEY: &str = "ublkd.io/node";
