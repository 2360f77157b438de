"""Receipts: what a route proves about its work. Each worker commits to the exact bytes it took in
and sent out for every step of a request (`chain`), and signs that commitment with its node key
(`keys`); a head checks a route's receipts against each other (`verify`). Used by every worker
(worker/steps.py commits, the servicer signs), by a head (head/proofs.py) and by
`llama-shard verify-receipt`."""
