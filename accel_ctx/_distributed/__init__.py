"""_distributed"""
