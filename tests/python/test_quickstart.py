"""examples/quickstart.py, run as a user would, against a fresh server on each backend."""

import subprocess
import sys
import unittest

import anima_harness

QUICKSTART = anima_harness.REPO / "examples" / "quickstart.py"
# The whole flow is a dozen calls; a minute leaves room for a loaded machine.
QUICKSTART_DEADLINE_SECONDS = 60


class Quickstart(unittest.TestCase):
    def run_quickstart(self, server):
        result = subprocess.run([sys.executable, str(QUICKSTART), "--server", server.addr],
                                capture_output=True, text=True, timeout=QUICKSTART_DEADLINE_SECONDS)
        self.assertEqual(result.returncode, 0, f"{result.stdout}\n{result.stderr}\n{server.stderr()}")
        # Given a fresh server, the quickstart goes from a DM to a held send and a resend.
        for line in ["registered agent ada", "wake dm", "send held (1 new message)", "> actually, it is rolling back",
                     "resend allowed", "quickstart: done"]:
            self.assertIn(line, result.stdout)

    def test_on_the_embedded_log(self):
        server = anima_harness.Server()
        self.addCleanup(server.stop)
        self.run_quickstart(server)

    def test_on_jetstream(self):
        nats = anima_harness.NatsServer()
        self.addCleanup(nats.stop)
        server = anima_harness.Server(nats_url=nats.url)
        self.addCleanup(server.stop)
        self.run_quickstart(server)


if __name__ == "__main__":
    unittest.main()
