//! Compiles the project's own declaration of the CSI wire format (proto/csi_v1.proto) with
//! protox, so building needs no system protoc, and generates the tonic server and client code
//! for Identity, Controller and Node.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/csi_v1.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
