"""A Slack connector at full speed: N observations over S concurrent `Ingest.AppendStream` calls on
one grpcio channel, each call sending as fast as gRPC flow control lets it. Every request must be
answered, in order, without an error and without the connection going away.

    python3 tests/python/flood.py [--messages 100000] [--streams 4] [--server ADDR] [--nats URL]

Without --server it starts its own `anima-wake` (embedded log, or JetStream with --nats).
"""

import argparse
import sys
import threading
import time

import anima_harness

# Payload of each message: short, like most chat messages (small DATA frames are what h2 guards).
TEXT = "deploy finished, all green"


def _requests(api, events, stream_index, count):
    channel = f"CFLOOD{stream_index}"
    for n in range(count):
        yield api.AppendStreamRequest(append=api.AppendRequest(
            correlation_id=f"{stream_index}-{n}",
            slack_message=api.SlackMessage(
                receiving_agent_ids=["ada"],
                kind=events.SLACK_DELIVERY_KIND_MESSAGE,
                team_id="T1",
                channel_id=channel,
                ts=f"{1700000000 + n}.{stream_index:06d}",
                user_id="U1",
                text=TEXT,
            ),
        ))


def flood(addr, messages, streams, metadata=()):
    """Returns the figures: messages, answered, streams, seconds, errors (a list of strings)."""
    import grpc
    anima_harness.generated_dir()
    from anima.v1 import api_pb2 as api
    from anima.v1 import api_pb2_grpc
    from anima.v1 import events_pb2 as events

    channel = grpc.insecure_channel(addr)
    ingest = api_pb2_grpc.IngestStub(channel)
    ingest.Append(api.AppendRequest(agent=events.AgentRegistered(
        agent_id="ada", slack_bot_user_id="U0ADA", slack_bot_id="B0ADA")), metadata=metadata, timeout=30)
    per_stream = [messages // streams + (1 if i < messages % streams else 0) for i in range(streams)]
    answered = [0] * streams
    errors = []
    lock = threading.Lock()

    def run(index):
        expected = 0
        try:
            for response in ingest.AppendStream(_requests(api, events, index, per_stream[index]), metadata=metadata):
                want = f"{index}-{expected}"
                if response.correlation_id != want:
                    raise AssertionError(f"answer {response.correlation_id!r}, expected {want!r}")
                if response.WhichOneof("result") != "appended":
                    raise AssertionError(f"{want}: {response.error.code} {response.error.message}")
                expected += 1
        except Exception as e:  # An RpcError (GOAWAY, UNAVAILABLE) or a wrong answer.
            with lock:
                errors.append(f"stream {index} after {expected} answers: {e}")
        answered[index] = expected

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - started
    channel.close()
    return {"messages": messages, "answered": sum(answered), "streams": streams,
            "seconds": round(seconds, 2), "errors": errors}


def report(figures):
    rate = figures["answered"] / figures["seconds"] if figures["seconds"] else 0
    return (f"flood: {figures['messages']} messages over {figures['streams']} AppendStream calls, "
            f"{figures['answered']} answered in {figures['seconds']} s ({rate:,.0f}/s), "
            f"{len(figures['errors'])} errors" + "".join(f"\n  {e}" for e in figures["errors"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--server", help="host:port of a running server (default: start one)")
    parser.add_argument("--nats", help="with no --server: start it on JetStream at this URL")
    args = parser.parse_args()
    server = None if args.server else anima_harness.Server(nats_url=args.nats)
    try:
        figures = flood(args.server or server.addr, args.messages, args.streams)
    finally:
        if server is not None:
            server.stop()
    print(report(figures))
    return 0 if not figures["errors"] and figures["answered"] == figures["messages"] else 1


if __name__ == "__main__":
    sys.exit(main())
