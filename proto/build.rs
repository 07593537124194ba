fn main() {
    prost_build::compile_protos(&["monitor.proto"], &["."])
        .expect("compile monitor.proto (protoc is needed: apt-get install protobuf-compiler)");
}
