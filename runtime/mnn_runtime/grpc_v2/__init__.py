"""Generated code of the Open Inference Protocol v2 gRPC service (``grpc_predict_v2.proto``).

Committed so that the serving image needs only grpcio and protobuf; ``generate.py`` rebuilds it.
"""
