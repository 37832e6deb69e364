"""A connector streaming at full speed from grpcio: >= 100,000 Slack observations over 4 concurrent
AppendStream calls on one connection. Every message is answered and the connection never goes
away (h2's small-DATA-frame guard once answered such floods with GOAWAY too_many_data_frames)."""

import unittest

import anima_harness
import flood

MESSAGES = 100_000
STREAMS = 4


class Flood(unittest.TestCase):
    def test_every_message_is_answered_and_the_connection_stays(self):
        server = anima_harness.Server()
        self.addCleanup(server.stop)
        figures = flood.flood(server.addr, MESSAGES, STREAMS)
        print("\n" + flood.report(figures), flush=True)
        self.assertEqual(figures["errors"], [], server.stderr())
        self.assertEqual(figures["answered"], MESSAGES)


if __name__ == "__main__":
    unittest.main()
