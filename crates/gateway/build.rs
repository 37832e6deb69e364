//! Compiles the gRPC services of `api.proto` with `protox` (no `protoc` needed) into tonic code.
//! The messages are generated once, in `anima-projections` (which knows no tonic); here the file's
//! messages are stripped so only services are generated, referring to those types. The full
//! descriptor set is kept for server reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut descriptors =
        protox::compile([root.join("anima/v1/api.proto"), root.join("anima/v1/replay.proto")], [&root])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("anima_descriptor.bin"), prost::Message::encode_to_vec(&descriptors))?;
    descriptors.file.retain(|f| matches!(f.name(), "anima/v1/api.proto" | "anima/v1/replay.proto"));
    for file in &mut descriptors.file {
        file.message_type.clear();
        file.enum_type.clear();
    }
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .extern_path(".anima.v1", "::anima_projections::proto")
        .compile_fds(descriptors)?;
    Ok(())
}
