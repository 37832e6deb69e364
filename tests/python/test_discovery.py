"""Discovery as gRPC tools in other languages do it: grpcio-reflection (v1alpha), the standard
health service for every service, NOT_SERVING once the server drains, and the token rules."""

import unittest

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import anima_harness

ADMIN_TOKEN = "admin-token-0123456789"
CONFIG = f"""
[[tokens]]
name = "admin"
token = "{ADMIN_TOKEN}"
role = "admin"
"""
API_SERVICES = ["anima.v1.Ingest", "anima.v1.Wakes", "anima.v1.Sends", "anima.v1.Subscriptions",
                "anima.v1.Memory", "anima.v1.Replay", "anima.v1.Analytics"]
CALL_DEADLINE_SECONDS = 30


def list_services(channel, metadata):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=CALL_DEADLINE_SECONDS)
    return sorted(s.name for s in next(responses).list_services_response.service)


class Discovery(unittest.TestCase):
    def setUp(self):
        self.server = anima_harness.Server(config=CONFIG)
        self.addCleanup(self.server.stop)
        self.channel = grpc.insecure_channel(self.server.addr)
        self.addCleanup(self.channel.close)

    def test_reflection_v1alpha_lists_every_service_with_any_token_and_none_without(self):
        # Given a server with tokens, when grpcio-reflection (v1alpha only) lists the services
        # with a token (the scheme in lower case),
        services = list_services(self.channel, [("authorization", f"bearer {ADMIN_TOKEN}")])
        # then every API service and the health service are there;
        for service in API_SERVICES + ["grpc.health.v1.Health"]:
            self.assertIn(service, services)
        # without a token, reflection is refused.
        with self.assertRaises(grpc.RpcError) as refused:
            list_services(self.channel, [])
        self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_health_reports_every_service_without_a_token_and_not_serving_once_draining(self):
        health = health_pb2_grpc.HealthStub(self.channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        # Given a running server, every service (and the server as a whole) is SERVING, no token needed.
        for service in [""] + API_SERVICES:
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_DEADLINE_SECONDS)
            self.assertEqual(response.status, serving, service)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="anima.v1.Ingest"), timeout=CALL_DEADLINE_SECONDS)
        self.assertEqual(next(watch).status, serving)
        # When shutdown starts (SIGTERM), the watcher hears NOT_SERVING and its stream ends,
        self.server.terminate()
        self.assertEqual([r.status for r in watch], [health_pb2.HealthCheckResponse.NOT_SERVING])
        # and the server exits cleanly.
        self.assertEqual(self.server.process.wait(anima_harness.STOP_DEADLINE_SECONDS), 0, self.server.stderr())


if __name__ == "__main__":
    unittest.main()
