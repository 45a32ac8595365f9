from eval.main_job import main

if __name__ == "__main__":
    main()
