"""Subscriptions.List by page, from a stock-protoc Python client against the real server."""

import unittest

import grpc

import anima_harness

# How long one call may take on a loaded machine.
CALL_DEADLINE_SECONDS = 30


class SubscriptionPages(unittest.TestCase):
    def setUp(self):
        anima_harness.generated_dir()
        from anima.v1 import api_pb2, api_pb2_grpc, events_pb2
        self.api, self.events = api_pb2, events_pb2
        self.server = anima_harness.Server()
        self.addCleanup(self.server.stop)
        self.channel = grpc.insecure_channel(self.server.addr)
        self.addCleanup(self.channel.close)
        self.ingest = api_pb2_grpc.IngestStub(self.channel)
        self.subscriptions = api_pb2_grpc.SubscriptionsStub(self.channel)
        for agent, user in [("ada", "U0ADA"), ("bob", "U0BOB")]:
            self.ingest.Append(self.api.AppendRequest(agent=self.events.AgentRegistered(
                agent_id=agent, slack_bot_user_id=user, slack_bot_id=f"B{user[1:]}")), timeout=CALL_DEADLINE_SECONDS)

    def mention_in_new_threads(self, threads):
        """Top-level messages in one channel that mention both agents: each agent follows every
        thread it is mentioned in, and the channel itself."""
        for i in range(1, threads + 1):
            appended = self.ingest.Append(self.api.AppendRequest(slack_message=self.api.SlackMessage(
                receiving_agent_ids=["ada", "bob"], kind=self.events.SLACK_DELIVERY_KIND_MESSAGE, team_id="T1",
                channel_id="C1", ts=f"17000000{i:02d}.000100", user_id="U1", user_name="sam",
                text="<@U0ADA> <@U0BOB> a look?")), timeout=CALL_DEADLINE_SECONDS)
            self.assertEqual([(o.agent_id, o.wake_reason) for o in appended.outcomes],
                             [("ada", "mention"), ("bob", "mention")], appended)

    def page(self, agent, page_size, page_token=""):
        return self.subscriptions.List(self.api.SubscriptionsListRequest(
            agent_id=agent, page_size=page_size, page_token=page_token), timeout=CALL_DEADLINE_SECONDS)

    def test_pages_walk_the_whole_list_in_order(self):
        self.mention_in_new_threads(9)
        whole = self.page("ada", 0)
        self.assertEqual(whole.next_page_token, "", "the default page holds ten subscriptions")
        surfaces = [s.surface for s in whole.subscriptions]
        self.assertEqual(len(surfaces), 10, f"the channel and its nine threads: {surfaces}")
        self.assertEqual(len(set(surfaces)), 10, surfaces)
        walked, token, pages = [], "", 0
        while True:
            page = self.page("ada", 3, token)
            pages += 1
            self.assertLessEqual(len(page.subscriptions), 3, page)
            walked += [s.surface for s in page.subscriptions]
            token = page.next_page_token
            if not token:
                break
            self.assertLess(pages, 20, "the pages never end")
        self.assertEqual(walked, surfaces, "the pages, in order, are the whole list")

    def test_a_bad_or_foreign_page_token_is_refused(self):
        self.mention_in_new_threads(4)
        first = self.page("ada", 2)
        self.assertNotEqual(first.next_page_token, "")
        for bad in ["zz", "0", "ab" * 40]:
            with self.assertRaises(grpc.RpcError) as refused:
                self.page("ada", 2, bad)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, bad)
            self.assertTrue(refused.exception.details().startswith("page_token:"), refused.exception.details())
        with self.assertRaises(grpc.RpcError) as refused:
            self.page("bob", 2, first.next_page_token)
        self.assertEqual(refused.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, "ada's token on bob's list")


if __name__ == "__main__":
    unittest.main()
