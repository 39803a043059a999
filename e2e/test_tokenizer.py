"""End-to-end: exact routing for chat prompts through a real Envoy (docs/design/tokenizer.md).

The replicas run the real o200k_harmony BPE (`kvsteer-sim --tokenizer o200k_harmony`) and the filter
is configured with the same vocabulary and the `kvsteer_sim` chat template (the simulator's chat
framing), so both compute the same token ids and KV block hashes. A multi-turn chat must land, turn
after turn, on the replica holding its prefix, and that replica must report the earlier turns' blocks
as cached (`usage.prompt_tokens_details.cached_tokens`), which the approximate identity cannot promise.
"""

from __future__ import annotations

import time
import unittest

from client import cached_tokens, chat_completion, prose
from stack import Stack, envoy_fleet
from test_envoy import FEED_SETTLE_S, PEER_SETTLE_S, REPLICAS, TIME_SCALE, stat_sum

TOKENIZER = {"vocabulary": "o200k_harmony", "chat_template": "kvsteer_sim"}


class ExactChatRouting(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = envoy_fleet(REPLICAS, TIME_SCALE, sim_args=["--tokenizer", "o200k_harmony"],
                                plugin_overrides={"tokenizer": TOKENIZER})

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def test_a_multi_turn_chat_stays_on_its_prefix_and_is_served_from_cache(self) -> None:
        for convo in range(3):
            messages = [{"role": "system", "content": prose(1000 + convo, 1500)}]
            home = None
            for turn in range(4):
                messages.append({"role": "user", "content": prose(100 * convo + turn, 120)})
                doc = chat_completion(self.stack.listen_port, messages)
                replica = doc["_replica"]
                prompt = doc["usage"]["prompt_tokens"]
                if turn == 0:
                    home = replica
                    self.assertGreater(prompt, 1500, doc["usage"])
                else:
                    self.assertEqual(replica, home, f"conversation {convo} turn {turn}: {doc['usage']}")
                    # Everything before this turn's new messages was cached on that replica: at
                    # least the previous prompt, less its last partial block.
                    self.assertGreaterEqual(cached_tokens(doc), previous - 16,
                                            f"conversation {convo} turn {turn}: {doc['usage']}")
                previous = prompt
                answer = doc["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": answer})
                time.sleep(FEED_SETTLE_S + PEER_SETTLE_S)
        self.assertGreater(stat_sum(self.stack, "kvsteer_tokenizer_exact"), 0)
        self.assertGreater(stat_sum(self.stack, "kvsteer_tokenizer_cache_hits"), 0)

    def test_unknown_roles_fall_back_and_are_counted(self) -> None:
        before = stat_sum(self.stack, "kvsteer_tokenizer_fallback_unknown_role")
        doc = chat_completion(self.stack.listen_port, [{"role": "wizard", "content": prose(7, 50)}])
        self.assertTrue(doc["_replica"])
        deadline = time.time() + 5
        while time.time() < deadline:
            if stat_sum(self.stack, "kvsteer_tokenizer_fallback_unknown_role") > before:
                break
            time.sleep(0.2)
        self.assertGreater(stat_sum(self.stack, "kvsteer_tokenizer_fallback_unknown_role"), before)


if __name__ == "__main__":
    unittest.main()
