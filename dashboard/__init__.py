"""Streamlit app: predictions, users, offline metrics, stream health. Reads, never trains."""
