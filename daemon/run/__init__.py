"""Running collectives: a schedule over the peer links (`executor.py`) and the
inter-daemon phase of a multi-node job (`multi_node.py`: local reduce, wait
for the formation, agree `auto`'s costs, run the plan, write back)."""
