"""A GRU over a user's last K states that picks one ad query per visit."""
