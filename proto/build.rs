fn main() {
    tonic_prost_build::configure()
        .compile_protos(&["monitor.proto"], &["."])
        .expect("compile monitor.proto (protoc is needed: apt-get install protobuf-compiler)");
}
