"""The model card, its pictures, and the push to the Hub."""
