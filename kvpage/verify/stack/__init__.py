"""The whole stack under the gate: the OpenAI server driven in-process against a text-level
oracle, and the replica router against a brute-force model of its policy."""
