//! Compiles the protobuf messages with `protox` (no `protoc` needed): the stored event schema and
//! the messages of the gRPC API (the gateway generates only the service code, from the same
//! descriptors, so each protobuf type has one Rust type). Keeps the encoded descriptor set, so
//! tests can check the content marking of every string field of the stored schema.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let files =
        [root.join("anima/v1/events.proto"), root.join("anima/v1/api.proto"), root.join("anima/v1/replay.proto")];
    let mut compiler = protox::Compiler::new([&root])?;
    compiler.include_imports(true).open_files(&files)?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Encoded by protox itself: going through prost_types would drop the extension options
    // (the content marking), which prost_types does not know.
    std::fs::write(out.join("events_descriptor.bin"), compiler.encode_file_descriptor_set())?;
    let mut config = prost_build::Config::new();
    config.btree_map(["."]);
    config.compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
