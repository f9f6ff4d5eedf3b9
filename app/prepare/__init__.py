"""`foreserve prepare`: build the embedded model folder and the ShareGPT replay traces."""
