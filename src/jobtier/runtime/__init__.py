"""What every long-running part shares: back-off, stopping within a bound, periodic loops."""
