"""The delaying relay (bench.relay) that stands in for a network link: every call through it
takes at least its round trip, what crosses it is unchanged, and it stops cleanly."""

from __future__ import annotations

import time

import grpc

from bench.relay import DelayRelay
from deploy import hosting
from deploy.configs import ModelServiceConfig
from specdec.v1 import model_pb2, model_pb2_grpc


def test_calls_through_the_relay_take_its_round_trip_and_cross_unchanged(tiny_backends):
    server, port = hosting.serve_model(ModelServiceConfig("target"), tiny_backends["target"])
    try:
        direct = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        expected = direct.Describe(model_pb2.DescribeRequest(), timeout=10)
        for rtt_ms in (0, 40):
            with DelayRelay(f"127.0.0.1:{port}", rtt_ms) as relay:
                channel = grpc.insecure_channel(relay.address)
                stub = model_pb2_grpc.TargetServiceStub(channel)
                assert stub.Describe(model_pb2.DescribeRequest(), timeout=10) == expected  # connects, warms up
                seconds = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    stub.Describe(model_pb2.DescribeRequest(), timeout=10)
                    seconds.append(time.perf_counter() - t0)
                assert min(seconds) >= rtt_ms / 1000  # a call is a message each way: one round trip at least
                channel.close()
    finally:
        server.stop(None)
