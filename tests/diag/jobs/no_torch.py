"""No torch at all: a data-preparation script that counts words and exits."""

import collections
import sys

counts = collections.Counter(
    ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "the", "end"]
)
print("most common:", counts.most_common(1)[0], flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
