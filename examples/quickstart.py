"""Quickstart: a connector and an agent runtime in Python, from a fresh `anima-wake serve` to a held
send and its resend.

    pip install grpcio-tools                       # grpcio and protoc for Python
    cargo run -p anima-gateway --bin anima-wake -- serve --data /tmp/anima-quickstart
    python3 examples/quickstart.py --server 127.0.0.1:50051

It generates its client code from the repo's proto/ with stock protoc (so it cannot drift from
the API), then: registers the agent, ingests a Slack DM, watches for the wake, claims and starts
it, lets a foreign message arrive, asks to send (held: the conversation moved), asks again
(allowed), confirms the post and finishes the wake. The test suite runs it on both backends.
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

PROTO = pathlib.Path(__file__).resolve().parents[1] / "proto"


def generate_client(out):
    """Python code for every message and service of proto/, as any protoc user would generate it."""
    protos = sorted(str(p) for p in (PROTO / "anima" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={out}",
                    f"--grpc_python_out={out}", *protos], check=True)
    sys.path.insert(0, out)


def slack_ts(offset):
    """A Slack message ts ("seconds.micros") unique to this run."""
    return f"{int(time.time()) + offset}.{time.time_ns() // 1000 % 1_000_000:06d}"


def main():
    parser = argparse.ArgumentParser(description="Anima wake engine quickstart")
    parser.add_argument("--server", default="127.0.0.1:50051", help="host:port of anima-wake serve")
    parser.add_argument("--token", help="an admin token, when the server has [[tokens]]")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="anima-quickstart-") as out:
        generate_client(out)
        run(args)


def run(args):
    """The quickstart's calls, with the client code generated and on sys.path."""
    import grpc
    from anima.v1 import api_pb2 as api
    from anima.v1 import api_pb2_grpc
    from anima.v1 import events_pb2 as events

    channel = grpc.insecure_channel(args.server)
    grpc.channel_ready_future(channel).result(timeout=30)
    # `authorization: Bearer <token>` on every call; a server without tokens needs none.
    auth = [("authorization", f"Bearer {args.token}")] if args.token else []
    ingest = api_pb2_grpc.IngestStub(channel)
    wakes = api_pb2_grpc.WakesStub(channel)
    sends = api_pb2_grpc.SendsStub(channel)

    # 1. Register the agent before anything is ingested for it (else: `unknown agent "ada"`).
    #    Its Slack bot user id and bot id tell its own posts from foreign ones.
    ingest.Append(api.AppendRequest(agent=events.AgentRegistered(
        agent_id="ada", slack_bot_user_id="U0ADA", slack_bot_id="B0ADA")), metadata=auth, timeout=30)
    print("registered agent ada")

    # 2. The Slack connector ingests a DM. A channel id starting with `D` is a DM, which wakes the
    #    agent (reason "dm"); `kind` is required (MESSAGE, or APP_MENTION for app_mention events).
    def dm(ts, text):
        return api.AppendRequest(slack_message=api.SlackMessage(
            receiving_agent_ids=["ada"], kind=events.SLACK_DELIVERY_KIND_MESSAGE, team_id="T1",
            channel_id="DQUICK", ts=ts, user_id="U1", user_name="sam", text=text))

    appended = ingest.Append(dm(slack_ts(0), "hi ada, did the deploy finish?"), metadata=auth, timeout=30)
    outcome = appended.outcomes[0]
    assert outcome.wake_reason == "dm", appended
    print(f"ingested a DM: seq {outcome.seq}, surface {outcome.surface}, wake {outcome.wake_reason}")

    # 3. The runtime watches for claimable wakes (a stream; no polling).
    signals = wakes.Watch(api.WatchRequest(agent_id="ada"), metadata=auth, timeout=30)
    for signal in signals:
        if signal.claimable:
            print(f"watch: {signal.queued} queued, claimable as of seq {signal.as_of_seq}")
            break
    signals.cancel()

    # 4. Claim it: one winner among workers, with the text to show the agent and where to answer.
    worker = "quickstart-worker"
    wake = wakes.Claim(api.ClaimRequest(agent_id="ada", worker_id=worker), metadata=auth, timeout=30).wake
    assert wake.item_id, "nothing to claim"
    print(f"claimed {wake.item_id} ({wake.reason}); the agent is shown:\n{wake.text}")

    # 5. Start it with the plan exactly as claimed: the agent has now seen those messages.
    wakes.Start(api.StartRequest(agent_id="ada", worker_id=worker, item_id=wake.item_id, plan=wake.plan),
                metadata=auth, timeout=30)
    print("started")

    # 6. While the agent drafts its answer, a foreign message arrives in the DM.
    ingest.Append(dm(slack_ts(1), "actually, it is rolling back"), metadata=auth, timeout=30)
    print("a foreign message arrived")

    # 7. Ask before posting: held, with what arrived since the agent last looked.
    draft = "Yes, the deploy finished."
    send = api.SendRequest(agent_id="ada", target=wake.reply_to, kind=events.SEND_KIND_MESSAGE,
                           draft_bytes=len(draft.encode()))
    first = sends.Send(send, metadata=auth, timeout=30)
    assert first.WhichOneof("verdict") == "held", first
    print(f"send held ({first.held.new_messages} new message):\n{first.held.notice}")

    # 8. The agent has now seen it; asking again (with a revised draft) is allowed.
    draft = "It finished, but it is rolling back now; I will look."
    second = sends.Send(send, metadata=auth, timeout=30)
    assert second.WhichOneof("verdict") == "allowed", second
    print("resend allowed")

    # 9. Post to Slack (not done here), then confirm the post with the ts Slack gave it.
    confirmed = sends.Confirm(api.SendsConfirmRequest(
        agent_id="ada", target=wake.reply_to, kind=events.SEND_KIND_MESSAGE, ts=slack_ts(2), text=draft),
        metadata=auth, timeout=30)
    print(f"confirmed the post: seq {confirmed.seq}, own row {confirmed.ordinal}")

    # 10. Finish the wake.
    finished = wakes.Finish(api.FinishRequest(agent_id="ada", worker_id=worker, item_id=wake.item_id,
                                              outcome=events.WAKE_OUTCOME_COMPLETED), metadata=auth, timeout=30)
    print(f"finished at seq {finished.finished_at_seq}")
    channel.close()
    print("quickstart: done")


if __name__ == "__main__":
    main()
