"""The acceptance walks: training predicts acceptance with them and validation replays served text through them."""
