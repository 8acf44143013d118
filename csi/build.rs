//! Compiles the vendored CSI spec (proto/csi/v1/csi.proto) with protox, so building needs no
//! system protoc, and generates the tonic server and client code for Identity, Controller and
//! Node.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/csi/v1/csi.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
