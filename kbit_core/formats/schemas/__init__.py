"""Record schemas (Avro .avsc, protobuf .proto) and the protobuf module generated from kbit.proto."""
