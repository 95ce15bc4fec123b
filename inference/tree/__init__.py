"""Draft trees: the tree step's plan and loop (plan.py), the EAGLE-3 tree proposer that drafts
them (loop.py), and the tree's pure torch references (ops.py). docs/trees.md explains the step."""
