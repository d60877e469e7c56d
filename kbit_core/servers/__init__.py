"""The servers a team profile adds to the local stack: PostgreSQL, s3proxy, and the logins kbit keeps for them."""
