//! Compiles proto/ublkd/v1/ublkd.proto with protox (a pure-Rust protobuf compiler, so building
//! needs no system protoc) and generates the tonic client and server code. The file descriptor
//! set is kept for gRPC server reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/ublkd/v1/ublkd.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("ublkd_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
