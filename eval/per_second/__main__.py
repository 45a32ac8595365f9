from eval.per_second import main

if __name__ == "__main__":
    main()
