"""The documentation: the site builds strictly, and every example of docs/ and README.md runs or says why not."""
